"""The programs a run compiles and keeps: each plan's step, built by the model's programs and
compiled under `remat="auto"`'s policy where asked (remat_choice.py), its layout moves left
for later (deferred.py), the likely next plans' steps compiled in a background thread
(precompile.py), JAX's persistent compilation cache (compile_cache.py), the count of what
was compiled on which thread (compiles.py), and the trainer's keeper of all of them, with
the program that runs now (keeper.py)."""
