"""Work as Ray tasks on a cluster (`sweep --ray`, `bench --ray`): reaching the cluster, what one task asks for, and
the loop that submits the tasks, hands each result over as it lands and cancels the rest when one fails.

Each task runs alone on its node's devices: on a GPU it takes one whole GPU (Ray hands each task its own device
through CUDA_VISIBLE_DEVICES); on CPUs it asks for as many CPUs as the smallest node of the cluster has, so no two
tasks ever share a node's cores, and the task sets its torch threads to that count. Tasks are spread over the
nodes (Ray's SPREAD scheduling), each node taking the next task when it is free. A task whose node dies is run
again by Ray on another node (MAX_RETRIES); an error inside a task is one line naming what it measured.
"""

from __future__ import annotations

import socket
from typing import Callable

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.reporting.schema import first_line

MAX_RETRIES = 3  # a task whose node dies is run again on another, this many times at most
CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """HOST:PORT (or ray://HOST:PORT) answers a connection within seconds: Ray itself would retry for minutes."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise SdbenchError(f"--ray {address}: give auto or the cluster's HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise SdbenchError(f"--ray {address}: no Ray cluster there ({e.strerror or e}); start one with "
                           f"`ray start --head` and give its address, or auto on its head node") from None


def connect(address: str):
    """Ray, connected to the cluster at `address` ("auto": the one `ray start` began on this machine)."""
    _check_reachable(address)
    try:
        import ray
    except ImportError:
        raise MissingPackageError("ray", "--ray", "pip install 'sdbench[ray]'` or `pip install ray==2.60.0") \
            from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise SdbenchError(f"--ray {address}: no Ray cluster there ({first_line(e)}); start one with "
                               f"`ray start --head` and give its address, or auto on its head node") from None
    return ray


def task_resources(ray, device: str) -> tuple[dict, int]:
    """(Ray resources of one task, its torch threads; 0: leave them): a whole GPU, or as many CPUs as the
    cluster's smallest node has."""
    if device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0):
        return {"num_gpus": 1, "num_cpus": 1}, 0
    cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU")]
    if not cpus:
        raise SdbenchError("--ray: the cluster has no node with CPUs to run a task on")
    return {"num_cpus": min(cpus)}, int(min(cpus))


def where() -> dict:
    """Inside a task: the host and Ray node it runs on."""
    import ray

    return {"host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id()}


def describe(ray, address: str, resources: dict) -> str:
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    asked = ", ".join(f"{v:g} {k.removeprefix('num_').upper()}" for k, v in resources.items())
    return f"on {nodes} node{'s' if nodes != 1 else ''} ({address}), each with {asked}"


def run_tasks(ray, function, calls: dict, resources: dict, on_result: Callable[[object, dict], None]) -> None:
    """function(*args) as a task per `calls` entry (label -> args); on_result(label, result) as each lands, in the
    order they finish. Any failure cancels the tasks still running and is raised as one line naming the label."""
    from ray.exceptions import RayError, RayTaskError

    task = ray.remote(function).options(max_retries=MAX_RETRIES, retry_exceptions=False,
                                        scheduling_strategy="SPREAD", **resources)
    pending = {task.remote(*args): label for label, args in calls.items()}
    try:
        while pending:
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            label = pending.pop(ready)
            try:
                result = ray.get(ready)
            except RayTaskError as e:  # the task itself raised: its own first line
                raise SdbenchError(f"{label}: {first_line(getattr(e, 'cause', None) or e)}") from None
            except RayError as e:  # its node died more than MAX_RETRIES times, or Ray lost it
                raise SdbenchError(f"{label}: Ray could not run it ({first_line(e)})") from None
            on_result(label, result)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
