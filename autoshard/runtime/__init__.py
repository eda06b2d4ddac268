"""Stage 5, runtime: what the emitted program calls (collectives in `comm`, local
kernels in `ops`), the cross-rank agreement check (`agreement`), the rank pool
(`ranks`) and link measurement on it (`calibrate`). `comm` and `ops` need only the
words and sit before the rules (`tests/test_imports.py`): an op's registry entry
holds its lowering, which names its kernel."""
