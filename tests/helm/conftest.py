"""Render helpers for the Helm chart tests: offline, through the Helm v4 SDK (helm-python-sdk).

helm_python and yaml (PyYAML, installed with kubernetes-validate) are imported where used, so
that without them test_chart.py skips itself with a reason instead of this conftest failing
to import and taking the rest of the suite down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helm.manifests import parse_manifests

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "rollout-sidecar"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*.yaml"))
BAD_VALUES = sorted((Path(__file__).parent / "bad-values").glob("*.yaml"))
RELEASE = "rs"
NAMESPACE = "ml"

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`ci_file` runs a test once per chart CI values file, `bad_file` once per bad one."""
    for fixture, files in (("ci_file", CI_VALUES), ("bad_file", BAD_VALUES)):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, files, ids=[f.stem for f in files])


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _deep_merge(dict(base[key]), value)
        else:
            base[key] = value
    return base


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def load_values() -> Callable[[Path], dict[str, Any]]:
    """A values file as `helm install -f` reads it (Helm's YAML dialect, not PyYAML's)."""
    import helm_python

    return lambda path: helm_python.values_from_yaml(path.read_text())


@pytest.fixture(scope="session")
def ci_values(load_values: Callable[[Path], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The chart's CI values files by name (file stem)."""
    return {path.stem: load_values(path) for path in CI_VALUES}


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def _merge_layers(layers: tuple[dict[str, Any], ...], overrides: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in (*layers, overrides):
        merged = _deep_merge(merged, layer)
    return merged


@pytest.fixture(scope="session")
def render(chart: Any) -> Render:
    """render(*values, **overrides) -> objects: the values deep-merged in order, as repeated
    `-f`/`--set` do, then the keyword overrides. Helm checks the result against
    values.schema.json first, as `helm install` does.
    """

    def _render(*layers: dict[str, Any], **overrides: Any) -> list[Manifest]:
        merged = _merge_layers(layers, overrides)
        return parse_manifests(chart.render(merged, name=RELEASE, namespace=NAMESPACE))

    return _render


@pytest.fixture(scope="session")
def render_notes(chart: Any) -> Callable[..., str]:
    """render_notes(*values, **overrides) -> the NOTES.txt `helm install` prints."""

    def _render(*layers: dict[str, Any], **overrides: Any) -> str:
        rendered = chart.render(_merge_layers(layers, overrides), name=RELEASE, namespace=NAMESPACE)
        (notes,) = [text for path, text in rendered.items() if path.endswith("/NOTES.txt")]
        return notes

    return _render


@pytest.fixture(scope="session")
def render_chart() -> Callable[..., list[Manifest]]:
    """Render another chart directory (e.g. a user's chart depending on this one), optionally
    with values on top of its own."""
    import helm_python

    def _render(path: Path, values: dict[str, Any] | None = None) -> list[Manifest]:
        with helm_python.Chart.load(path) as loaded:
            return parse_manifests(loaded.render(values, name=RELEASE, namespace=NAMESPACE))

    return _render
