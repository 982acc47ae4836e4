"""`python -m jaxflash.demo` in miniature: the jaxflash and standard-attention runs train alike."""
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from jaxflash import demo  # noqa: E402


def test_text_ships_with_the_package():
    text = demo.load_text()
    assert len(text) > 30_000 and text.startswith("First Citizen:")


def test_loss_curves_agree_and_fall():
    cfg = demo.Config(width=32, heads=2, layers=1, seq=32, batch=8, steps=40, lr=1e-2)
    lines = []
    flash, standard, diff, tol = demo.run(cfg, every=10, out=lines.append)
    assert len(flash) == len(standard) == 40
    assert diff <= tol
    assert abs(flash[0] - standard[0]) <= 1e-5 * standard[0]  # same weights, same first batch
    assert flash[-5:].mean() < flash[0] - 0.8  # ln(58) = 4.06 at the start: it learns
    assert lines[-1].endswith("equal within tolerance")
