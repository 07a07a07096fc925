"""A stand-in for libtpu's runtime metrics server, for fleet hosts without TPUs.

libtpu serves its metrics over gRPC on the worker's local ports named by
TPU_RUNTIME_METRICS_PORTS (8431 first): the service
``tpu.monitoring.runtime.RuntimeMetricService``, method ``GetRuntimeMetric``, which
answers a ``MetricRequest`` (field 1: the metric's name) with a ``MetricResponse``
holding one ``TPUMetric`` whose ``metrics`` carry, per device, an attribute with the
device id (``int_attr``) and a gauge (``as_int`` for bytes, ``as_double`` for percent).
Google's ``tpu-info`` reads ``tpu.runtime.hbm.memory.usage.bytes``,
``tpu.runtime.hbm.memory.total.bytes`` and ``tpu.runtime.tensorcore.dutycycle.percent``.

This server speaks that service with real grpcio, its messages built at run time from a
descriptor holding only the fields it uses (same package, names and numbers), and
answers with the numbers in a JSON file the test writes and may rewrite at any time::

    {"chips": [{"chip": 0, "hbm_used": 123, "hbm_total": 456, "duty": 85.0}, ...]}

Run in a fleet host's network namespace, its localhost is the host's:
``ip netns exec <netns> python -m testfleet.runtime_metrics --port 8431 --values F``.
``serve`` (below) does that for a test and stops it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

SERVICE = "tpu.monitoring.runtime.RuntimeMetricService"
USAGE = "tpu.runtime.hbm.memory.usage.bytes"
TOTAL = "tpu.runtime.hbm.memory.total.bytes"
DUTY = "tpu.runtime.tensorcore.dutycycle.percent"
_REPO = Path(__file__).resolve().parent.parent


def _messages():
    """MetricRequest and MetricResponse classes from a minimal descriptor."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    optional, repeated = F.LABEL_OPTIONAL, F.LABEL_REPEATED

    def message(name, *fields):
        proto = descriptor_pb2.DescriptorProto(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = proto.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
        return proto

    pkg = ".tpu.monitoring.runtime."
    file = descriptor_pb2.FileDescriptorProto(
        name="testfleet/tpu_metric_service.proto", package="tpu.monitoring.runtime"
    )
    file.message_type.extend([
        message("AttrValue", ("int_attr", 3, F.TYPE_INT64, optional, "")),
        message("Attribute", ("key", 1, F.TYPE_STRING, optional, ""),
                ("value", 2, F.TYPE_MESSAGE, optional, pkg + "AttrValue")),
        message("Gauge", ("as_double", 1, F.TYPE_DOUBLE, optional, ""),
                ("as_int", 2, F.TYPE_INT64, optional, "")),
        message("Metric", ("attribute", 1, F.TYPE_MESSAGE, optional, pkg + "Attribute"),
                ("gauge", 3, F.TYPE_MESSAGE, optional, pkg + "Gauge")),
        message("TPUMetric", ("name", 1, F.TYPE_STRING, optional, ""),
                ("description", 2, F.TYPE_STRING, optional, ""),
                ("metrics", 3, F.TYPE_MESSAGE, repeated, pkg + "Metric")),
        message("MetricRequest", ("metric_name", 1, F.TYPE_STRING, optional, "")),
        message("MetricResponse", ("metric", 1, F.TYPE_MESSAGE, optional, pkg + "TPUMetric")),
    ])  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    get = message_factory.GetMessageClass
    return (
        get(pool.FindMessageTypeByName("tpu.monitoring.runtime.MetricRequest")),
        get(pool.FindMessageTypeByName("tpu.monitoring.runtime.MetricResponse")),
    )


def make_server(port: int, values: Path):
    """A started grpc server on 127.0.0.1:``port`` with local credentials, as libtpu's."""
    import grpc

    request_class, response_class = _messages()

    def get_runtime_metric(request, context):
        try:
            chips = json.loads(values.read_text())["chips"]
        except (OSError, ValueError, KeyError):
            context.abort(grpc.StatusCode.UNAVAILABLE, "no values yet")
        response = response_class()
        response.metric.name = request.metric_name
        for chip in chips:
            if request.metric_name == USAGE:
                value = {"as_int": int(chip["hbm_used"])}
            elif request.metric_name == TOTAL:
                value = {"as_int": int(chip["hbm_total"])}
            elif request.metric_name == DUTY:
                value = {"as_double": float(chip["duty"])}
            else:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no metric {request.metric_name}")
            metric = response.metric.metrics.add()
            metric.attribute.key = "device-id"
            metric.attribute.value.int_attr = int(chip["chip"])
            for name, number in value.items():
                setattr(metric.gauge, name, number)
        return response

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "GetRuntimeMetric": grpc.unary_unary_rpc_method_handler(
                get_runtime_metric,
                request_deserializer=request_class.FromString,
                response_serializer=response_class.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_secure_port(
        f"127.0.0.1:{port}", grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    )
    server.start()
    return server


def write_values(path: Path, chips: list[dict]) -> None:
    """The numbers the server answers from now on (written whole, then renamed)."""
    new = path.with_suffix(".new")
    new.write_text(json.dumps({"chips": chips}))
    new.replace(path)


def start(fleet, host_name: str, values: Path, port: int = 8431) -> subprocess.Popen:
    """The stand-in server on ``host_name``'s localhost, starting (``wait_serving``)."""
    netns = fleet.host(host_name).netns
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "testfleet.runtime_metrics",
         "--port", str(port), "--values", str(values)],
        cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_serving(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    if not line.startswith(b"serving"):
        stop(process)
        raise RuntimeError(f"the metrics stand-in did not start: {line!r}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def serve(fleet, host_name: str, values: Path, port: int = 8431):
    """The stand-in server on ``host_name``'s localhost while the block runs."""
    process = start(fleet, host_name, values, port)
    try:
        wait_serving(process)
        yield process
    finally:
        stop(process)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--values", type=Path, required=True)
    args = parser.parse_args(argv)
    server = make_server(args.port, args.values)
    print(f"serving {args.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
