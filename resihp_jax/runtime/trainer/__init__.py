"""The resilient training loop (resilient.py) and its parts (docs/DESIGN.md, "trainer/")."""
