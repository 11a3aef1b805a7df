"""Which collectives of a compiled program a pipeline branch would leave some devices out of
(meshes/branch_collectives.py), read from HLO text as XLA prints it."""

from __future__ import annotations

from resihp_jax.meshes.branch_collectives import branch_collectives, replica_groups

HLO = """
HloModule step

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%inner (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %cp = f32[4] collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/cond/branch_1_fun/split"}
}

%busy (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  %tp = f32[4] all-reduce(%p), channel_id=2, replica_groups=[4,2]<=[8], to_apply=%add, metadata={op_name="jit(step)/cond/branch_1_fun/dot_general"}
  %dp = f32[4] all-reduce(%tp), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, metadata={op_name="jit(step)/cond/branch_1_fun/psum"}
  ROOT %c = f32[4] call(%dp), to_apply=%inner
}

%idle (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4] parameter(0)
}

ENTRY %main (p: f32[4], q: s32[]) -> f32[4] {
  %p = f32[4] parameter(0)
  %q = s32[] parameter(1)
  %top = f32[4] all-reduce(%p), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %perm = f32[4] collective-permute(%top), channel_id=5, source_target_pairs={{0,2},{2,0}}
  ROOT %b = f32[4] conditional(%q, %perm, %perm), branch_computations={%idle, %busy}
}
"""


def test_the_collectives_a_branch_would_leave_devices_out_of_are_named() -> None:
    found = branch_collectives(HLO, tp=2)
    # the dp all-reduce and the permute the branch calls; not the tp all-reduce, nor
    # anything outside the branch
    assert sorted((c.op, c.describe()) for c in found) == [
        ("all-reduce", "all-reduce from 'psum'"),
        ("collective-permute", "collective-permute from 'split'")]
    assert branch_collectives(HLO.replace("branch_computations={%idle, %busy}",
                                          "branch_computations={%idle, %idle}"), tp=2) == []


def test_every_replica_group_form_is_read() -> None:
    assert replica_groups("replica_groups={{0,2},{1,3}}, x") == [[0, 2], [1, 3]]
    assert replica_groups("replica_groups=[4,2]<=[8], x") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x") == [[0, 2, 4, 6],
                                                                      [1, 3, 5, 7]]
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}") is None
    # a form it cannot read counts as leaving devices out: refused rather than risked
    unread = HLO.replace("replica_groups=[4,2]<=[8]", "replica_groups=mesh['a'=4,'b'=2] {'b'}")
    assert len(branch_collectives(unread, tp=2)) == 3
