"""Dynamic tensor management: shape policies, collation and resumable batch iteration."""

from .loader import Batch, OverflowReport, ShapedLoader, make_items
from .policy import SHAPE_POLICIES, BatchPlan, Segment, ShapePolicy, get_shape_policy, register_shape_policy

__all__ = [
    "SHAPE_POLICIES",
    "Batch",
    "BatchPlan",
    "OverflowReport",
    "Segment",
    "ShapePolicy",
    "ShapedLoader",
    "get_shape_policy",
    "make_items",
    "register_shape_policy",
]
