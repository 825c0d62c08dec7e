"""The snippets of docs/extending.md work: each ``python`` block is executed as written and what it
registered is looked up through the registries the engine reads (and, for the domain, used)."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from domains import DOMAINS, reward_fn, unregister_domain
from modelserver.backends import inference_backend, unregister_inference_backend
from modelserver.launch import LocalServer
from engine.config import EngineConfig, InferenceConfig
from ops.deployment import backend_errors
from sandboxes.registry import sandbox_backend, unregister_sandbox_backend

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def snippets() -> dict[str, str]:
    """The ``python`` blocks of the doc by the ``## `` heading they sit under."""
    found: dict[str, str] = {}
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        for block in re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S):
            found[title] = found.get(title, "") + block
    return found


def run_snippet(title: str) -> dict[str, object]:
    code = snippets()[title]
    assert len(code.splitlines()) < 60, f"{title}: the snippet should stay under 60 lines"
    namespace: dict[str, object] = {"__name__": f"extending_doc_{title.replace(' ', '_')}"}
    exec(compile(code, f"{DOC}:{title}", "exec"), namespace)
    return namespace


@pytest.fixture
def cleanup() -> Iterator[None]:
    yield
    unregister_domain("sort_numbers")
    unregister_sandbox_backend("bwrap_seeded")
    unregister_inference_backend("local_small")


def test_the_doc_has_the_three_snippets() -> None:
    assert set(snippets()) == {"A new domain", "A new sandbox backend", "A new inference backend"}


def test_the_domain_snippet_registers_a_working_domain(cleanup: None) -> None:
    run_snippet("A new domain")
    domain = DOMAINS["sort_numbers"]
    prompt, spec = domain.generate(random.Random(3), difficulty=1.0)
    numbers = spec["numbers"]
    assert prompt.startswith("Sort ascending: ") and len(numbers) == 8
    right = " ".join(map(str, sorted(numbers)))
    facts_right = asyncio.run(domain.verify(right, spec, None))  # type: ignore[operator]
    facts_short = asyncio.run(domain.verify(right.rsplit(" ", 1)[0], spec, None))  # type: ignore[operator]
    assert facts_right == {"correct": True, "numbers_given": 8}
    assert facts_short == {"correct": False, "numbers_given": 7}
    assert reward_fn("sort_numbers", facts_short, right) == 0.0
    assert reward_fn("sort_numbers", facts_right, right) == 1.0


def test_the_sandbox_backend_snippet_registers_a_backend_the_config_accepts(cleanup: None) -> None:
    namespace = run_snippet("A new sandbox backend")
    backend = sandbox_backend("bwrap_seeded")
    assert backend.create == namespace["SeededSandbox"].create  # type: ignore[attr-defined]
    assert backend.reap is not None
    assert backend_errors(EngineConfig.model_validate({"sandbox": {"backend": "bwrap_seeded"}})) == []


def test_the_inference_backend_snippet_registers_a_launcher(cleanup: None, tmp_path: Path) -> None:
    run_snippet("A new inference backend")
    launch = inference_backend("local_small").launch
    assert launch is not None
    assert backend_errors(EngineConfig.model_validate({"inference": {"backend": "local_small"}})) == []
    server = launch(InferenceConfig(backend="local_small"), tmp_path / "model", tmp_path)
    assert isinstance(server, LocalServer) and server.max_batch == 8
    assert server.log_path == tmp_path / "logs" / "inference-server.log"
