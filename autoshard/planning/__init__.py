"""Stage 4, planning: the settings (`options`), one layout per node (`planner`), the
graph cut into units (`units`), a plan's step time and peak (`estimate`), the
MILP over families and recomputation (`solver`), the result (`plan`) and its
check against a model (`verify`)."""
