"""Task ``digits_ode``: a neural-ODE classifier on scikit-learn's bundled 8x8 digits.

Same data, training step and metrics as ``digits_cnn`` (``train_loss`` / ``train_acc`` per step,
``val_loss`` / ``val_acc`` on validation); the network is Linear -> ``ode.ODEBlock`` -> Linear
(:class:`recipes.models.ode_net.DigitsODENet`). Enable the ``interp_adjoint`` section to train the
block with the interpolated adjoint (Daulbaev et al., NeurIPS 2020); ``model.grad`` is the method
used otherwise (and restored after fit). Needs the ``ode`` extra (torchdiffeq).
"""
from __future__ import annotations

from dataclasses import dataclass

from recipes.errors import InvalidValue
from recipes.optim import OptimConfig
from recipes.registry import Task
from recipes.tasks.digits_cnn import CLASSIFIER_METRICS, DigitsDataConfig


@dataclass
class ODEModelConfig:
    """The ``model:`` section of ``digits_ode`` (see :class:`recipes.models.ode_net.DigitsODENet`).

    Attributes:
        width: State size of the ODE block.
        hidden: Hidden units of its dynamics MLP.
        t_end: Integration time of the block (from 0).
        grad: Gradient method outside the plugin: ``adjoint``, ``interpolated`` or ``backprop``.
        method: torchdiffeq solver (``dopri5``, ...).
        rtol: Solver relative tolerance.
        atol: Solver absolute tolerance.
        n_nodes: Nodes stored by the interpolated adjoint (odd, 3..129).
    """

    width: int = 32
    hidden: int = 64
    t_end: float = 1.0
    grad: str = "adjoint"
    method: str = "dopri5"
    rtol: float = 1e-4
    atol: float = 1e-6
    n_nodes: int = 17

    def __post_init__(self) -> None:
        for name in ("width", "hidden"):
            if getattr(self, name) < 1:
                raise InvalidValue(name, getattr(self, name), "expected an int >= 1")
        if not self.t_end > 0:
            raise InvalidValue("t_end", self.t_end, "expected a float > 0")
        from ode import GRAD_METHODS
        from ode.nodes import MAX_NODES, MIN_NODES

        if self.grad not in GRAD_METHODS:
            raise InvalidValue("grad", self.grad, f"expected one of {', '.join(GRAD_METHODS)}")
        for name in ("rtol", "atol"):
            if not getattr(self, name) > 0:
                raise InvalidValue(name, getattr(self, name), "expected a float > 0")
        if not (MIN_NODES <= self.n_nodes <= MAX_NODES and self.n_nodes % 2 == 1):
            raise InvalidValue("n_nodes", self.n_nodes,
                               f"expected an odd int in [{MIN_NODES}, {MAX_NODES}]")
        # The block checks its solver settings (the method's name among them) with this class.
        from ode import SolveConfig

        try:
            SolveConfig(grad=self.grad, method=self.method, rtol=self.rtol, atol=self.atol,
                        n_nodes=self.n_nodes)
        except ImportError as e:
            raise InvalidValue("method", self.method, str(e)) from e
        except ValueError as e:  # "method='x': not a torchdiffeq solver; choose one of ..."
            message = str(e)
            key = message.partition("=")[0]
            key = key if key in ("grad", "method", "rtol", "atol", "n_nodes") else "method"
            prefix = f"{key}={getattr(self, key)!r}: "
            reason = message[len(prefix):] if message.startswith(prefix) else message
            raise InvalidValue(key, getattr(self, key), reason) from e


def build(model: ODEModelConfig, data: DigitsDataConfig, optim: OptimConfig):
    """Build the ``digits_ode`` LightningModule and DataModule."""
    from recipes.data.digits import DigitsDataModule  # Lightning: only when a run builds
    from recipes.models.ode_net import DigitsODENet
    from recipes.tasks._classifier import DigitsClassifier

    net = DigitsODENet(width=model.width, hidden=model.hidden, t_end=model.t_end,
                       grad=model.grad, method=model.method, rtol=model.rtol, atol=model.atol,
                       n_nodes=model.n_nodes)
    datamodule = DigitsDataModule(
        batch_size=data.batch_size, val_fraction=data.val_fraction, split_seed=data.split_seed,
        shuffle_seed=data.shuffle_seed,
    )
    return DigitsClassifier(net, optim=optim), datamodule


TASK = Task(
    model=ODEModelConfig,
    data=DigitsDataConfig,
    build=build,
    description="neural-ODE classifier (ode.ODEBlock) on scikit-learn's bundled 8x8 digits",
    metrics=CLASSIFIER_METRICS,
)
