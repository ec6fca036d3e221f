"""Flags and start-up steps shared by the server commands, and their one frame (``serve``)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

S = TypeVar("S")
"""A started service: ``.metrics.registry`` (its Prometheus registry) and ``stop([grace])``."""


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default info)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def add_service_args(p: argparse.ArgumentParser, *, metrics_port: int, serves: str | None, calls: str | None,
                     grace: bool = True, metrics_help: str = "Prometheus /metrics port") -> None:
    """The flags every service command ends with: ``--metrics-port``, ``--grace`` (a server's drain on
    SIGTERM), the security flags (``add_security_args``) and ``--log-level``."""
    p.add_argument("--metrics-port", type=int, default=metrics_port,
                   help=f"{metrics_help}, 0 = off (default {metrics_port})")
    if grace:
        p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_security_args(p, serves=serves, calls=calls)
    add_tracing_args(p)
    add_log_level(p)


def serve(args: argparse.Namespace, log: logging.Logger, start: Callable[[], S],
          serving: Callable[[S], None] | None = None, background: Callable[[S], None] | None = None) -> int:
    """The frame of every service command (kv-service, router, worker, bridge): logging, the security
    flags, ``start()``, /metrics, ``serving(service)`` (what the command says once it serves), then
    SIGTERM / SIGINT and the stop: ``service.stop(args.grace)``, or ``service.stop()`` for a command
    without ``--grace``.

    Args:
        start: builds and starts the service; a ValueError or OSError it raises is one error line
            (no traceback) and exit status 2.
        background: run on a thread once the signals are handled: a start that waits (the bridge
            waits for its engine) and that SIGTERM must still end; a ValueError or TimeoutError it
            raises is logged and ends the command with status 2.

    Returns:
        The exit status.
    """
    setup_logging(args.log_level)
    try:
        apply_security(args)
        # NOTE: the service's name in its spans is its logger's: kvmesh.kv_service -> kvmesh-kv-service.
        apply_tracing(args, log.name.replace(".", "-").replace("_", "-"), getattr(args, "worker_id", None) or "")
        service = start()
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_port:
        start_metrics_server(args.metrics_port, service.metrics.registry)
    if serving is not None:
        serving(service)
    grace: float | None = getattr(args, "grace", None)
    done = threading.Event()
    status = 0

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: %s", signum, "stopping" if grace is None else f"draining for up to {grace:.1f}s")
        done.set()

    def start_in_background(service: S, background: Callable[[S], None]) -> None:
        nonlocal status
        try:
            background(service)
        except (ValueError, TimeoutError) as exc:
            log.error("%s", exc)
            status = 2
            done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if background is not None:
            threading.Thread(target=start_in_background, args=(service, background), daemon=True).start()
        while not done.wait(0.5):
            pass
    finally:
        if grace is None:
            service.stop()
        else:
            service.stop(grace)
        from kvmesh.transport import tracing

        tracing.shutdown()  # the spans still buffered go out before the process ends
    return status


def start_metrics_server(port: int, registry: CollectorRegistry) -> None:
    """Serves ``registry`` (the service's own, made at its start) on ``/metrics`` at ``port``."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, registry=registry)
    except OSError as exc:
        logging.getLogger("kvmesh").warning("Prometheus /metrics not started on port %d: %s", port, exc)


COST_MODEL_FLAGS = (("step_overhead_s", "fixed seconds per step"),
                    ("prefill_token_s", "seconds per new prefill token"),
                    ("attn_pair_s", "seconds per prefill (new x context) token pair"),
                    ("decode_seq_s", "seconds per decoding sequence"),
                    ("decode_kv_token_s", "seconds per context token read by a decode"))
"""The linear cost model's fields (model_worker/simulated/step_time.py LinearCost) and their help: ``--sim-step-overhead`` etc."""

def sim_choices() -> dict[str, tuple[str, ...]]:
    """Allowed values of StepTimeConfig's flags (--sim-cost-model, --sim-gpu)."""
    from kvmesh.model_worker.simulated.step_time import COST_MODELS, GPUS

    return {"cost_model": COST_MODELS, "gpu": tuple(GPUS)}


def add_cost_model_args(g: argparse._ArgumentGroup, defaults: object) -> None:
    """``--sim-<field>`` for each LinearCost field (dest ``sim_<field>_s``), defaults from ``defaults``."""
    for name, doc in COST_MODEL_FLAGS:
        g.add_argument(f"--sim-{name.removesuffix('_s').replace('_', '-')}", dest=f"sim_{name}", type=float,
                       default=getattr(defaults, name), help=f"{doc} (default {getattr(defaults, name):g})")


def linear_cost_from(args: argparse.Namespace):
    """The linear model of the --sim-* coefficients with ``--sim-cost-model linear`` (None with the
    roofline); ValueError when a coefficient is set for the roofline, which would ignore it."""
    from kvmesh.model_worker.simulated.step_time import LinearCost

    given = {f: getattr(args, f"sim_{f}") for f, _ in COST_MODEL_FLAGS}
    if args.cost_model == "linear":
        return LinearCost(**given)
    changed = [f"--sim-{f.removesuffix('_s').replace('_', '-')}" for f, v in given.items()
               if v != getattr(LinearCost(), f)]
    if changed:
        raise ValueError(f"{', '.join(changed)} set the linear cost model's coefficients: add --sim-cost-model linear")
    return None


def add_security_args(p: argparse.ArgumentParser, *, serves: str | None, calls: str | None) -> None:
    """TLS and token flags (docs/security.md).

    Args:
        serves: "api" or "admin": which token this command's server requires (None: no server).
        calls: "api" or "admin": which token it sends to the servers it calls (None: none).
    """
    g = p.add_argument_group("security (docs/security.md)")
    if serves:
        g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (+ --tls-key)")
        g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
        g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    if calls:
        g.add_argument("--tls-ca", default=None, metavar="PEM", help="dial servers over TLS, verified by this CA")
        g.add_argument("--tls-client-cert", default=None, metavar="PEM", help="client certificate for mutual TLS")
        g.add_argument("--tls-client-key", default=None, metavar="PEM", help="private key of --tls-client-cert")
    tokens = {t for t in (serves, calls) if t}
    if "api" in tokens:
        g.add_argument("--api-token-file", default=None, metavar="FILE",
                       help="the public API bearer token (default: $KVMESH_API_TOKEN; none = no auth)")
    if "admin" in tokens:
        g.add_argument("--admin-token-file", default=None, metavar="FILE",
                       help="the mesh's admin bearer token (default: $KVMESH_ADMIN_TOKEN; none = no auth)")
    p.set_defaults(_serves=serves, _calls=calls)


def apply_security(args: argparse.Namespace) -> None:
    """Configures kvmesh.transport.security for this process from the flags of ``add_security_args``."""
    from kvmesh.transport import security

    def token(kind: str | None) -> str | None:
        if kind == "api":
            return security.read_token(args.api_token_file, security.API_TOKEN_ENV)
        if kind == "admin":
            return security.read_token(args.admin_token_file, security.ADMIN_TOKEN_ENV)
        return None

    serves, calls = args._serves, args._calls
    server_tls = security.TLSFiles(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                                   getattr(args, "tls_client_ca", None))
    if bool(server_tls.cert) != bool(server_tls.key):
        raise ValueError("--tls-cert and --tls-key go together")
    client_tls = security.TLSFiles(getattr(args, "tls_client_cert", None), getattr(args, "tls_client_key", None),
                                   getattr(args, "tls_ca", None))
    security.configure(security.Security(server_tls, client_tls, token(serves), token(calls)))


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    """``--otlp-endpoint`` (docs/tracing.md): traces off unless given."""
    p.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                   help="export OpenTelemetry traces over OTLP/gRPC to this collector (e.g. 127.0.0.1:4317); "
                        "default: off (docs/tracing.md)")


def apply_tracing(args: argparse.Namespace, service: str, instance: str = "") -> None:
    """Turns tracing on for this process when ``--otlp-endpoint`` was given."""
    if getattr(args, "otlp_endpoint", None):
        from kvmesh.transport import tracing

        tracing.configure(args.otlp_endpoint, service, instance=instance)
