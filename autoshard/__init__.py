"""autoshard: plan and emit 3D tensor-parallel programs for PyTorch models.

mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
parallel = autoshard.parallelize(model, mesh, (x,), strategy="3d")
loss = parallel(x)          # every rank passes the full input, gets the full output
print(parallel.code)        # the rewritten program, collectives included
"""

from autoshard import checkpoint
from autoshard.api import Compiled, ParallelModule, compile, parallelize, plan
from autoshard.clip import clip_grad_norm_
from autoshard.cost.hardware import Hardware
from autoshard.errors import (
    AutoshardError,
    BudgetError,
    CheckpointError,
    HardwareError,
    InputError,
    MeshError,
    PlanError,
    ShapeError,
    StrategyError,
    TraceError,
)
from autoshard.layout import Layout, Step
from autoshard.mesh import Mesh
from autoshard.planning.plan import Plan
from autoshard.runtime.comm import CommLog, CommRecord, comm_log

__all__ = [
    "AutoshardError",
    "BudgetError",
    "CheckpointError",
    "Hardware",
    "HardwareError",
    "CommLog",
    "CommRecord",
    "Compiled",
    "InputError",
    "Layout",
    "Mesh",
    "MeshError",
    "ParallelModule",
    "Plan",
    "PlanError",
    "ShapeError",
    "Step",
    "StrategyError",
    "TraceError",
    "checkpoint",
    "clip_grad_norm_",
    "comm_log",
    "compile",
    "parallelize",
    "plan",
]
