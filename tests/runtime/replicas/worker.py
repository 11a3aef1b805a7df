"""One replica of one process for the engine's tests: least squares on a seeded global batch.

Each step's global batch is a function of the step alone; the replica takes its share of the
micro-batches, sums its gradient and squared error with the others' through the engine, and
applies the global mean. Every committed step is a JSON line: the step, the global loss, the
quorum's size, this replica's share and a checksum of its parameters.

`--die-at S` exits the process (as a crash would) after its gradients of step S, before the
sum; `--hang-at S` stops answering there instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from resihp_jax.runtime.replicas.shards import PieceMap, from_host_state, host_state
from resihp_jax.runtime.replicas.split import replica_slots, share_of, split_counts
from resihp_jax.runtime.replicas.torchft_engine import Timeouts, TorchftEngine

N_MICROBATCHES, ROWS, DIM = 6, 4, 8
LR = 0.1


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((N_MICROBATCHES, ROWS, DIM)).astype(np.float32)
    w_true = np.arange(DIM, dtype=np.float32) / DIM
    return x, (x @ w_true + 0.1 * rng.standard_normal((N_MICROBATCHES, ROWS))).astype(np.float32)


@jax.jit
def sums(w, x, y):
    def loss_sum(w):
        return jnp.sum((x @ w - y) ** 2)
    loss, grad = jax.value_and_grad(loss_sum)(w)
    return loss, grad, jnp.float32(x.shape[0] * x.shape[1])


def reference(steps: int) -> list[float]:
    """The uninterrupted run on one process: the losses every replica run must equal."""
    w = jnp.zeros(DIM, jnp.float32)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        loss, grad, count = sums(w, x.reshape(-1, DIM), y.reshape(-1))
        losses.append(float(loss / count))
        w = w - LR * grad / count
    return losses


def crc(w) -> int:
    return zlib.crc32(np.asarray(w).tobytes())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--pause-at", type=int, default=-1, help="wait there for --until")
    ap.add_argument("--until", default="", help="a file whose existence ends the pause")
    ap.add_argument("--ready", default="", help="a file made once the engine has joined")
    args = ap.parse_args()

    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    state = {"w": jnp.zeros(DIM, jnp.float32)}
    pieces = PieceMap.of(state["w"])

    def save() -> dict[str, np.ndarray]:
        return host_state(pieces.pieces(state["w"]), "w.")

    def load(host: dict[str, np.ndarray]) -> None:
        state["w"] = pieces.rebuild(from_host_state(host, "w.", pieces.n_pieces))

    engine = TorchftEngine(replica=args.replica, n_replicas=args.replicas, group_rank=0,
                           group_size=1, lighthouse=args.lighthouse, store_host="127.0.0.1",
                           store_port=store.port, state=(save, load),
                           timeouts=Timeouts(collective_s=1.0, heartbeat_s=1.5, join_s=10.0,
                                             quorum_s=60.0))
    if args.ready:
        open(args.ready, "w").close()
    slots = replica_slots(N_MICROBATCHES, args.replicas, dp_in=1)
    with open(args.out, "a") as out:
        while engine.step < args.steps:
            if engine.step == args.pause_at:
                while not os.path.exists(args.until):  # the test's restarted peer
                    time.sleep(0.01)
            quorum = engine.start_step()
            step = engine.step
            if quorum.healed:  # a peer's state, at the quorum's step
                out.write(json.dumps({"step": step, "committed": False, "healed": True}) + "\n")
            counts = split_counts(N_MICROBATCHES, np.ones(quorum.live), 1, slots)
            share = share_of(quorum.rank, counts, 1)
            x, y = global_batch(step)
            part = slice(share.first, share.first + share.count)
            loss, grad, count = sums(state["w"], x[part].reshape(-1, DIM), y[part].reshape(-1))
            if step == args.die_at:
                os._exit(17)
            if step == args.hang_at:
                time.sleep(3600)
            loss, grad, count = engine.sum_pieces([loss, grad, count])
            if not engine.commit():
                out.write(json.dumps({"step": step, "committed": False}) + "\n")
                out.flush()
                continue
            state["w"] = state["w"] - LR * jnp.asarray(grad) / float(count)
            out.write(json.dumps({"step": step, "committed": True, "pid": os.getpid(),
                                  "loss": float(loss) / float(count), "live": quorum.live,
                                  "rank": quorum.rank, "first": share.first,
                                  "count": share.count, "healed": quorum.healed,
                                  "crc": crc(state["w"])}) + "\n")
            out.flush()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
