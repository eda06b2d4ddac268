"""Stage 3, cost: hardware numbers (`hardware`) and what each node costs under a
layout, in time and bytes (`model`)."""
