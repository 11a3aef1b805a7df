"""The runtime: training that survives slow and dead devices, in five rooms (docs/DESIGN.md's
map): `trainer/` the loop, `programs/` the steps it compiles and keeps, `recovery/` the state
that outlives a fault, `job/` the multi-process job and its supervisor, `run/` the run
`resihp train` performs, as a library object built from typed configs.
"""
