"""The programs a run compiles and keeps (docs/DESIGN.md, "programs/")."""
