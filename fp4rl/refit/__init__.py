"""Refit: stream the trainer's weights into the rollout engine after every update, failing
closed.

    transport = InProcessTransport()                    # or DistributedTransport(peer) per side
    transport.send(refit_records(trainer, policy_version=step + 1))         # trainer's side
    RefitReceiver(engine).receive(transport.receive())                       # engine's side

`protocol` holds the records, `sender` walks the trainer's model, `transport` carries the
records, `receiver` checks them one by one, quantizes the FP4 layers' routed experts at load and
writes into the engine's existing storage; a refit that is not applied in full leaves the
engine refusing to generate (`RefitError`, ``Engine.invalid``).
"""

from fp4rl.refit.protocol import Abort, EndOfStream, NamedTensor, Record, RefitError
from fp4rl.refit.receiver import RefitReceiver
from fp4rl.refit.sender import refit_records
from fp4rl.refit.transport import DistributedTransport, InProcessTransport, Transport

__all__ = [
    "Abort",
    "DistributedTransport",
    "EndOfStream",
    "InProcessTransport",
    "NamedTensor",
    "Record",
    "RefitError",
    "RefitReceiver",
    "Transport",
    "refit_records",
]
