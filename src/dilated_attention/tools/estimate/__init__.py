"""``dilated-attention estimate``: per-rank peak memory and traffic, without running.

The op's memory is what its own code allocates, run on meta tensors with a fake
process group (``dryrun``), at the real length or, for long ranks, at two shorter
ones with the rest composed (``scaled``, Note [estimate]); what is arithmetic,
traffic and the call's inputs and outputs, is in ``formula``; ``config`` checks the
options and ``report`` prints.
"""

from .config import EstimateConfig, make_config
from .report import report
from .scaled import Estimate, check_dry_run, dry_run, estimate

__all__ = ["Estimate", "EstimateConfig", "check_dry_run", "dry_run", "estimate", "make_config",
           "report"]
