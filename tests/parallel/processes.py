"""Processes joined by jax.distributed from the LMJAX_* environment, for the multi-process tests: each gets the
same coordinator and its own LMJAX_PROCESS_ID; a hung peer never outlives the test."""
import os
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_joined(cmd: list[str], num: int = 2, timeout: int = 300) -> list[tuple[int, str, str]]:
    """[(returncode, stdout, stderr)] of `num` copies of `cmd`, process i with LMJAX_PROCESS_ID=i."""
    env = {**os.environ, "LMJAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "LMJAX_NUM_PROCESSES": str(num)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "LMJAX_PROCESS_ID": str(i)}) for i in range(num)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
