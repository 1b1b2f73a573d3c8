"""Under ft=torchft a restarted worker takes its step counter from a peer when it rejoins
(in set-up): healed at the run's last exchange, it must stop before its first step, not
after it (a full-suite run once ended a worker at step 1201 of 1200)."""

from __future__ import annotations

from types import SimpleNamespace

from easgd_lightning.ft.strategies import _FTMixin


class _Strategy:
    def on_train_start(self) -> None:
        self.base_started = True


class _Joiner(_FTMixin, _Strategy):
    def __init__(self, local_steps: int, total: int) -> None:
        self._ft_total = total
        self._local_steps = local_steps
        self.lightning_module = SimpleNamespace(trainer=SimpleNamespace(should_stop=False))


def test_a_joiner_healed_at_the_last_step_stops_before_training() -> None:
    joiner = _Joiner(local_steps=1200, total=1200)
    joiner.on_train_start()
    assert joiner.base_started  # the strategy's own start still runs
    assert joiner.lightning_module.trainer.should_stop


def test_a_fresh_or_early_joiner_trains_on() -> None:
    for steps in (0, 536, 1199):
        joiner = _Joiner(local_steps=steps, total=1200)
        joiner.on_train_start()
        assert not joiner.lightning_module.trainer.should_stop, steps
