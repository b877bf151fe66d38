"""The SPMD type checker of the parallel mappings (spmd_typing.py): it reads every folder of distributed/, and none
of them reads it (tests/typecheck.py runs it)."""
