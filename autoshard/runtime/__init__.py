"""Stage 5, runtime: what the emitted program calls (collectives in `comm`, local
kernels in `ops`), the cross-rank agreement check (`agreement`), the rank pool
(`ranks`) and link measurement on it (`calibrate`)."""
