"""Dynamic tensor management: bucket planning, token-budget batches, packing, mask-free ops.

Importing this package registers the shape policies pad_max, pad_batch, bucket and pack.
"""

from .loader import Batch, OverflowReport, ShapedLoader, make_items
from .ops import count_tokens, masked_mean, masked_sum, segment_sum, token_weights, weighted_select
from .packing import PackPolicy, pack_best_fit_decreasing, pack_greedy
from .planner import BucketPlan, plan_buckets
from .policy import SHAPE_POLICIES, BatchPlan, Segment, ShapePolicy, get_shape_policy, register_shape_policy
from .sampler import BucketPolicy

__all__ = [
    "SHAPE_POLICIES",
    "Batch",
    "BatchPlan",
    "BucketPlan",
    "BucketPolicy",
    "PackPolicy",
    "count_tokens",
    "masked_mean",
    "masked_sum",
    "pack_best_fit_decreasing",
    "pack_greedy",
    "plan_buckets",
    "segment_sum",
    "token_weights",
    "weighted_select",
    "OverflowReport",
    "Segment",
    "ShapePolicy",
    "ShapedLoader",
    "get_shape_policy",
    "make_items",
    "register_shape_policy",
]
