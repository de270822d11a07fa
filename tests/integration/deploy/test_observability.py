"""Traces and metrics of a real run: every service in its own process (the local launcher's stack),
traces exported over OTLP to a receiver in the test, /metrics scraped from every service while it trains.

- one connected trace per prompt group: controller lease -> rollout group -> generate (ttft, tokens,
  version, worker) / environment step (one rpc for the groups that score together, linked) / replay ingest,
  and the trainer step that consumed it linked;
- every metric the Grafana dashboard (deploy/compose/grafana/dashboards/flywheel.json) queries exists.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import load_config
from services.local import INFRA, LocalStack, read_metrics

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "compose" / "grafana" / "dashboards" / "flywheel.json"
STEPS, PROMPTS = 4, 2
SCRAPE_S = 0.02
METRIC_PREFIXES = ("flywheel_", "weight_sync_")
SELECTOR = re.compile(r"\b((?:%s)[a-zA-Z0-9_:]*)(\{[^}]*\})?" % "|".join(METRIC_PREFIXES))


def _scrape(port: int) -> str | None:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None  # not up yet, or (the trainer, after its last step) gone


def _series(text: str) -> set[str]:
    """The `name{labels}` of every sample line of a /metrics text, without its value."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def observed_run(otlp_receiver, tmp_path_factory):
    """Run STEPS tiny steps with OTLP export on; (spans, {service: every series any of its /metrics scrapes served}) once all stopped."""
    receiver, endpoint = otlp_receiver
    run_dir = tmp_path_factory.mktemp("observed")
    cfg = load_config(None, [f"grpo.max_num_steps={STEPS}", f"grpo.num_prompts_per_step={PROMPTS}",
                             f"telemetry.otlp_endpoint={endpoint}"])
    scrapes: dict[str, set[str]] = defaultdict(set)
    stopped = threading.Event()

    def scrape_while_training(ports: dict[str, int]) -> None:
        # On its own thread, often: these steps are so short that the trainer may finish all of them and exit
        # between two of wait_for's polls. Only after the first step: the labelled series exist by then. Every
        # scrape's series are kept: on a loaded machine the trainer's last good scrape may predate its step gauges.
        while not stopped.wait(SCRAPE_S):
            if read_metrics(run_dir):
                for name, port in ports.items():
                    text = _scrape(port) if name not in INFRA else None
                    if text is not None:
                        scrapes[name].update(_series(text))

    with LocalStack(cfg, run_dir) as stack:
        stack.start_services()
        scraper = threading.Thread(target=scrape_while_training, args=(dict(stack.children.metrics_ports),))
        scraper.start()
        try:
            stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
            trainer = stack.children.procs["trainer"]
            trainer.wait(timeout=60)  # it exits after its last step, flushing its spans
        finally:
            stopped.set()
            scraper.join()
    deadline = time.monotonic() + 15  # every service flushed at exit; the receiver may still be storing
    while time.monotonic() < deadline and not any(s.name == "trainer.step" for s in receiver.snapshot()):
        time.sleep(0.5)
    return receiver.snapshot(), scrapes


def _by_trace(spans):
    traces = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    return traces


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_consumed_prompt_group_is_one_connected_trace_across_the_services(observed_run):
    spans, _ = observed_run
    traces = _by_trace(spans)
    by_id = {s.span_id: s for s in spans}
    leases = [s for s in spans if s.name == "controller.lease"]
    assert leases, f"no lease spans among {sorted({s.name for s in spans})}"
    for lease in leases:  # one trace per prompt group: the lease is its root, and the only lease in it
        assert lease.service == "flywheel-controller" and lease.parent_id == ""
        assert [s.name for s in traces[lease.trace_id]].count("controller.lease") == 1

    consumed = [s for s in spans if s.name == "trainer.consume"]
    assert len(consumed) == STEPS * PROMPTS, "every group of every step is traced to its training step"
    steps = {s.span_id: s for s in spans if s.name == "trainer.step"}
    assert sorted(s.attributes["flywheel.step"] for s in steps.values()) == list(range(STEPS))
    for consume in consumed:
        trace = traces[consume.trace_id]
        names = {s.name: s for s in trace}
        lease, group = names["controller.lease"], by_id[consume.parent_id]
        assert group.name == "rollout.group" and group.parent_id == lease.span_id
        assert group.service == "flywheel-rollout" and group.attributes["flywheel.worker"]
        assert group.attributes["flywheel.group_id"] == lease.attributes["flywheel.group_id"] \
            == consume.attributes["flywheel.group_id"]
        children = [s for s in trace if s.parent_id == group.span_id]
        services = {s.name: s.service for s in children}
        assert services.get("rollout.generate") == "flywheel-rollout"
        # The group's Step: its own rollout.step span, and the environment's span under it, or, when groups
        # scored together in one rpc, under the first group's rollout.step, to which this one links.
        step_call = names["rollout.step"]
        assert step_call.parent_id == group.span_id and step_call.service == "flywheel-rollout"
        sent_from = {step_call.span_id} | {span_id for _, span_id in step_call.links}
        assert any(s.name == "environment.step" and s.service == "flywheel-environment"  # over gRPC metadata
                   and s.parent_id in sent_from for s in spans)
        assert services.get("replay.ingest") == "flywheel-replay"  # over NATS headers
        for generate in (s for s in children if s.name == "rollout.generate"):
            a = generate.attributes
            assert a["flywheel.ttft_s"] > 0 and a["flywheel.tokens"] > 0 and a["flywheel.version"] >= 0
            assert a["flywheel.worker"] == group.attributes["flywheel.worker"]
        # the training step and the group point at each other
        (_, step_span), = consume.links
        step = steps[step_span]
        assert step.attributes["flywheel.step"] == consume.attributes["flywheel.step"]
        assert (group.trace_id, group.span_id) in step.links


def _dashboard_selectors() -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) of every selector in every panel query of the dashboard."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            found = SELECTOR.findall(target["expr"])
            assert found, f"panel {panel['title']!r} queries no flywheel metric: {target['expr']}"
            for name, labels in found:
                matchers = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                assert labels.count("=") == len(matchers), f"only label=\"value\" matchers are checked: {labels}"
                out.append((name, matchers))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_metric_the_dashboard_queries_is_served_by_some_service(observed_run):
    _, scrapes = observed_run
    assert set(scrapes) >= {"controller", "environment", "replay", "trainer", "rollout-0"}, sorted(scrapes)
    text = "".join(f"{series} 0\n" for served in scrapes.values() for series in served)
    samples = [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]
    selectors = _dashboard_selectors()
    wanted = {"reward": "train/reward_mean", "KL": "train/kl_penalty"}
    for what, name in wanted.items():
        assert ("flywheel_trainer_step_metric", {"name": name}) in selectors, f"the dashboard shows no {what}"
    missing = [(name, matchers) for name, matchers in selectors
               if not any(n == name and matchers.items() <= labels.items() for n, labels in samples)]
    assert not missing, f"the dashboard queries series no service serves: {missing}"
