"""Differential privacy with accounted guarantees (``privacy.*``; docs/user-guide.md,
'Differential privacy').

* ``privacy.level = "client"``: DP-FedAvg, each client's model update clipped and Gaussian
  noise on their sum at the aggregator, for algorithms whose aggregation
  is a mean of client models (``PrivacySupport(client="mean")``): ``dp_fedavg``; with
  ``privacy.clip = "adaptive"`` the clip tracks a quantile of the update norms (``adaptive``).
* ``privacy.level = "sample"``: DP-SGD in every client's local training (``dpsgd``).
* ``accountant``: epsilon from Google's dp-accounting, never a formula of ours.
* ``per_round``: what the round loop calls; ``support``: the set-up checks and the trainer.

The engine imports this package; the algorithms only declare what they support
(``Algorithm.privacy``), so no algorithm can skip the clipping it declared.
"""

from edgepfl.privacy.dp_fedavg import PrivacyError
from edgepfl.privacy.per_round import RoundPrivacy, round_privacy
from edgepfl.privacy.support import check_privacy, make_trainer

__all__ = ["PrivacyError", "RoundPrivacy", "check_privacy", "make_trainer", "round_privacy"]
