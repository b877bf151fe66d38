"""submit/common.sh gives gloo the network interface NCCL uses (GLOO_SOCKET_IFNAME), for jobs across nodes."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import ROOT


def _sourced(snippet: str, **env: str) -> str:
    proc = subprocess.run(["bash", "-c", f"source submit/common.sh && {snippet}"], cwd=ROOT, check=False, text=True,
                          capture_output=True, timeout=30, env={"PATH": os.environ["PATH"], **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("nccl, master, want", [
    ("lo", "", "lo"), ("=lo", "", "lo"), ("lo,eth0", "", "lo"),  # NCCL's exact name(s): the first
    ("l", "", "lo"),  # a prefix: the node's first interface that starts with it
    ("^docker", "127.0.0.1", "lo"), ("", "localhost", "lo"),  # else the route to the rendezvous host
    ("", "", "")])
def test_gloo_follows_nccls_interface(nccl, master, want):
    env = {k: v for k, v in (("NCCL_SOCKET_IFNAME", nccl), ("MASTER_ADDR", master)) if v}
    assert _sourced("gloo_ifname", **env) == want


def test_the_job_environment_exports_it_and_keeps_the_users():
    job = {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7", "NCCL_SOCKET_IFNAME": "lo"}
    # a child shell reads it: exported
    stub = "scontrol() { echo 127.0.0.1; }; export_environment && bash -c 'echo $GLOO_SOCKET_IFNAME'"
    assert _sourced(stub, **job) == "lo"
    assert _sourced(stub, GLOO_SOCKET_IFNAME="ib7", **job) == "ib7"
