"""Flags and start-up steps shared by the server commands."""

from __future__ import annotations

import argparse
import logging


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default info)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def start_metrics_server(port: int) -> None:
    from prometheus_client import start_http_server

    try:
        start_http_server(port)
    except OSError as exc:
        logging.getLogger("kvmesh").warning("Prometheus /metrics not started on port %d: %s", port, exc)
