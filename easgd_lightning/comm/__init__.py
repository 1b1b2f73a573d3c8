"""Communication: the metered wrapper around torch.distributed and the CommMeter."""

from easgd_lightning.comm import ops
from easgd_lightning.comm.meter import CommMeter, KindTotals, get_meter, reset_meter

__all__ = ["ops", "CommMeter", "KindTotals", "get_meter", "reset_meter"]
