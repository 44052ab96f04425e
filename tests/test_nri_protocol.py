"""The NRI plugin's protocol (agent/nri/): ttrpc framing over NRI's multiplexer, registration,
configuration, synchronization in batches, pod events, failures returned to the runtime, and
reconnection after the runtime restarts. The runtime side here is tests/nri_standin.py
(agent/nri/ttrpc.Endpoint with the runtime's roles swapped); tests/test_realnode.py runs the plugin
against containerd's NRI.
"""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.nri.plugin import PKG, NriPlugin, event_mask
from agent.nri.ttrpc import MSG_HEADER, MUX_HEADER, UNIMPLEMENTED, CallError, Endpoint, ProtocolError
from agent.protos import nri_v1alpha1_pb2 as api
from agent.protos import ttrpc_wire_pb2 as wire
from tests.nri_standin import Runtime, sandbox



class CollectingWriter:
    """A stream writer that keeps what is written in ``sent``."""

    def __init__(self, sent: bytearray):
        self.sent = sent

    def write(self, data):
        self.sent.extend(data)

    async def drain(self):
        pass

    def close(self):
        pass

def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Recorder:
    def __init__(self, fail_on: str = ""):
        self.seen: list[tuple] = []
        self.fail_on = fail_on

    async def _add(self, what, *args):
        if what == self.fail_on:
            raise ValueError(f"{what} refused")
        self.seen.append((what, *args))

    def configured(self, request_timeout):
        self.seen.append(("configured", request_timeout))

    async def synchronized(self, pods):
        await self._add("sync", sorted(p.name for p in pods))

    async def pod_started(self, pod):
        await self._add("run", pod.name, pod.netns)

    async def pod_stopped(self, pod):
        await self._add("stop", pod.name)

    async def pod_removed(self, pod):
        await self._add("remove", pod.name)

    async def container_created(self, pod, container):
        await self._add("create", pod.name, container)


async def with_plugin(tmp_path, body, events=None):
    path = str(tmp_path / "nri.sock")
    runtime = Runtime(path, ((sandbox("a"),), (sandbox("b"),)))
    await runtime.start()
    events = events or Recorder()
    plugin = NriPlugin(path, events)
    task = asyncio.get_running_loop().create_task(plugin.run())
    try:
        return await body(runtime, plugin, events)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runtime.stop()


def test_registers_subscribes_synchronizes_and_gets_pod_events(tmp_path):
    async def body(runtime, plugin, events):
        ep, req, cfg, first = await runtime.registered.get()
        assert (req.plugin_name, req.plugin_idx) == ("sysdra", "50")
        assert cfg.events == event_mask([api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX,
                                       api.CREATE_CONTAINER]) == 0b1111
        assert cfg.failure_policy.fail_request
        assert first.more  # batches accepted
        await plugin.wait_for(lambda s: s.synchronized)
        for method, request, answer in (
                ("RunPodSandbox", api.RunPodSandboxRequest(pod=sandbox("p")), api.RunPodSandboxResponse),
                ("CreateContainer", api.CreateContainerRequest(pod=sandbox("p"), container=api.Container(name="c")),
                 api.CreateContainerResponse),
                ("StopPodSandbox", api.StopPodSandboxRequest(pod=sandbox("p")), api.StopPodSandboxResponse),
                ("RemovePodSandbox", api.RemovePodSandboxRequest(pod=sandbox("p", None)), api.RemovePodSandboxResponse)):
            await runtime.call(ep, method, request, answer)
        assert events.seen == [("configured", None), ("sync", ["a", "b"]), ("run", "p", "/run/netns/cni-1"), ("create", "p", "c"),
                               ("stop", "p"), ("remove", "p")]
        assert plugin.state.runtime == "test 1" and plugin.state.events["RunPodSandbox"] == 1

    run(with_plugin(tmp_path, body))


def test_a_failing_event_is_the_runtimes_error_and_unknown_methods_are_unimplemented(tmp_path):
    async def body(runtime, plugin, events):
        ep, *_ = await runtime.registered.get()
        with pytest.raises(CallError, match="status 2: run refused"):
            await runtime.call(ep, "RunPodSandbox", api.RunPodSandboxRequest(pod=sandbox("p")), api.RunPodSandboxResponse)
        with pytest.raises(CallError) as err:
            await runtime.call(ep, "UpdatePodSandbox", api.Empty(), api.Empty)
        assert err.value.code == UNIMPLEMENTED
        # the connection stays usable
        await runtime.call(ep, "StopPodSandbox", api.StopPodSandboxRequest(pod=sandbox("p")), api.StopPodSandboxResponse)
        assert events.seen[-1] == ("stop", "p")

    events = Recorder(fail_on="run")
    run(with_plugin(tmp_path, body, events))


def test_reconnects_when_the_runtime_restarts(tmp_path):
    async def body(runtime, plugin, events):
        await runtime.registered.get()
        await runtime.stop()
        await plugin.wait_for(lambda s: not s.connected)
        os.unlink(runtime.path)
        await runtime.start()
        await runtime.registered.get()
        await plugin.wait_for(lambda s: s.connected and s.synchronized)
        assert plugin.state.connections == 2

    run(with_plugin(tmp_path, body))


def test_a_message_split_over_frames_and_frames_with_two_messages(tmp_path):
    """The multiplexer carries byte streams: a ttrpc message may span frames."""
    async def body():
        got = []

        async def echo(payload):
            got.append(api.RegisterPluginRequest.FromString(payload).plugin_name)
            return api.Empty()

        reader = asyncio.StreamReader()
        sent = bytearray()
        ep = Endpoint(reader, CollectingWriter(sent), {(2, "s/m"): echo})
        msgs = b""
        for i, name in enumerate(("x", "y")):
            env = wire.Request(service="s", method="m", payload=api.RegisterPluginRequest(plugin_name=name).SerializeToString())
            data = env.SerializeToString()
            msgs += MSG_HEADER.pack(len(data), 2 * i + 1, 1, 0) + data
        for chunk in (msgs[:7], msgs[7:]):
            reader.feed_data(MUX_HEADER.pack(2, len(chunk)) + chunk)
        serving = asyncio.get_running_loop().create_task(ep.serve())
        while len(got) < 2:
            await asyncio.sleep(0.01)
        assert got == ["x", "y"]
        answers = bytes(sent)
        assert MUX_HEADER.unpack_from(answers)[0] == 2  # answered on the caller's connection
        reader.feed_eof()
        await serving

    run(body())


def test_oversized_frames_streaming_messages_and_other_conns_drop_the_connection():
    async def serve(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()

        class Writer:
            def write(self, data):
                pass

            def close(self):
                pass

        await Endpoint(reader, Writer(), {}).serve()

    with pytest.raises(ProtocolError, match="maximum"):
        run(serve(MUX_HEADER.pack(1, (4 << 20) + 11)))
    with pytest.raises(ProtocolError, match="maximum"):
        run(serve(MUX_HEADER.pack(1, 10) + MSG_HEADER.pack((4 << 20) + 1, 1, 1, 0)))
    with pytest.raises(ProtocolError, match="type 3"):
        run(serve(MUX_HEADER.pack(1, 10) + MSG_HEADER.pack(0, 1, 3, 0)))
    for cid in (0, 3, 7, 2**32 - 1):  # NRI's connections are 1 and 2: no buffer for any other
        with pytest.raises(ProtocolError, match=f"conn {cid}: NRI has connections 1 and 2 only"):
            run(serve(MUX_HEADER.pack(cid, 3) + b"abc"))
    assert struct.calcsize(">IIBB") == 10


def test_pod_events_over_state_change_as_nri_before_0_12_sends_them(tmp_path):
    """NRI up to v0.11 (containerd 1.7 to 2.2, CRI-O) has no RunPodSandbox/StopPodSandbox/
    RemovePodSandbox RPCs: it sends the subscribed pod sandbox events as ``StateChange`` (and
    NRI 0.12 falls back to it when the dedicated call is UNIMPLEMENTED). They are the same events."""
    async def body(runtime, plugin, events):
        ep, *_ = await runtime.registered.get()
        await plugin.wait_for(lambda s: s.synchronized)
        for event in (api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX):
            await runtime.call(ep, "StateChange", api.StateChangeEvent(event=event, pod=sandbox("p")), api.Empty)
        assert events.seen[2:] == [("run", "p", "/run/netns/cni-1"), ("stop", "p"), ("remove", "p")]
        assert plugin.state.events["RunPodSandbox"] == 1
        with pytest.raises(CallError, match="status 2: run refused"):  # the runtime fails the sandbox
            events.fail_on = "run"
            await runtime.call(ep, "StateChange", api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=sandbox("q")),
                               api.Empty)

    run(with_plugin(tmp_path, body))


def test_long_answers_go_in_frames_the_runtimes_reader_takes():
    """containerd's ttrpc reads its multiplexed connection through a 4096-byte bufio.Reader and
    NRI's mux fails a Read into a buffer shorter than the frame (ENOMEM: ``ttrpc: closed``, the
    plugin dropped). A long answer (a refusal naming many netdevs) goes in frames of 4096 at most."""
    async def body():
        async def refuse(payload):
            raise ValueError("netdev refused; " * 600)

        reader, sent = asyncio.StreamReader(), bytearray()
        ep = Endpoint(reader, CollectingWriter(sent), {(1, "s/m"): refuse})
        data = wire.Request(service="s", method="m").SerializeToString()
        reader.feed_data(MUX_HEADER.pack(1, MSG_HEADER.size + len(data)) + MSG_HEADER.pack(len(data), 1, 1, 0) + data)
        serving = asyncio.get_running_loop().create_task(ep.serve())
        while not sent:
            await asyncio.sleep(0.01)
        reader.feed_eof()
        await serving
        frames, stream, at = [], b"", 0
        while at < len(sent):
            cid, size = MUX_HEADER.unpack_from(sent, at)
            frames.append(size)
            stream += sent[at + MUX_HEADER.size:at + MUX_HEADER.size + size]
            at += MUX_HEADER.size + size
            assert cid == 1
        assert max(frames) <= 4096 and len(frames) > 1
        length, sid, kind, _ = MSG_HEADER.unpack_from(stream)
        assert (sid, kind, length) == (1, 2, len(stream) - MSG_HEADER.size)
        answer = wire.Response.FromString(stream[MSG_HEADER.size:])
        assert answer.status.code == 2 and answer.status.message == "netdev refused; " * 600

    run(body())


GOOD = [api.RunPodSandboxRequest(pod=sandbox("p")).SerializeToString(), api.SynchronizeRequest(pods=[sandbox("a")]).SerializeToString(),
        api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=sandbox("q")).SerializeToString()]
METHODS = ("Configure", "Synchronize", "Shutdown", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "CreateContainer",
           "StateChange", "UpdateContainer")
PAYLOAD = st.sampled_from(GOOD) | st.binary(max_size=40) | st.builds(  # a good message with bytes put in anywhere
    lambda good, at, junk: good[:at] + junk + good[at:], st.sampled_from(GOOD), st.integers(0, 80), st.binary(min_size=1, max_size=6))
REQUEST = st.tuples(st.just("request"), st.sampled_from((1, 1, 2)), st.integers(0, 2**32 - 1), st.sampled_from(METHODS), PAYLOAD,
                    st.sampled_from((0, -1, 1, 10**9, 2**63 - 1)), st.integers(0, 255))
STRAY = st.tuples(st.just("answer"), st.just(1), st.integers(0, 9), st.binary(max_size=20))  # for no call of ours


def _bytes(msg) -> bytes:
    if msg[0] == "answer":
        return MSG_HEADER.pack(len(msg[3]), msg[2], 2, 0) + msg[3]
    _, _, stream, method, payload, timeout, flags = msg
    data = wire.Request(service=f"{PKG}.Plugin", method=method, payload=payload, timeout_nano=timeout).SerializeToString()
    return MSG_HEADER.pack(len(data), stream, 1, flags) + data


def _answers(sent: bytes) -> list[tuple[int, int]]:
    """(conn, stream) of each answer written, its envelope a Response."""
    streams: dict[int, bytearray] = {}
    at = 0
    while at < len(sent):
        cid, size = MUX_HEADER.unpack_from(sent, at)
        streams.setdefault(cid, bytearray()).extend(sent[at + MUX_HEADER.size:at + MUX_HEADER.size + size])
        at += MUX_HEADER.size + size
    out = []
    for cid, data in streams.items():
        while data:
            length, stream, kind, _ = MSG_HEADER.unpack_from(data)
            assert kind == 2
            wire.Response.FromString(bytes(data[MSG_HEADER.size:MSG_HEADER.size + length]))
            out.append((cid, stream))
            del data[:MSG_HEADER.size + length]
    return sorted(out)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(REQUEST | STRAY, min_size=1, max_size=5), st.integers(1, 64))
def test_any_request_in_any_frames_is_answered_once(messages, frame):
    """Requests for any method (served or not), payloads good, garbled or none, any timeout, flags
    and stream ids (reused too), stray answers, each conn's bytes cut into frames of any size: the
    plugin answers each request once, on its conn and stream, and serves on until the runtime
    closes. Nothing the runtime sends in frames it may send fails the plugin's side."""
    async def body():
        reader, sent = asyncio.StreamReader(), bytearray()
        ep = Endpoint(reader, CollectingWriter(sent), NriPlugin("/nowhere", Recorder())._services())
        for msg in messages:
            data = _bytes(msg)
            for at in range(0, len(data), frame):
                reader.feed_data(MUX_HEADER.pack(msg[1], len(data[at:at + frame])) + data[at:at + frame])
        serving = asyncio.get_running_loop().create_task(ep.serve())
        while len(_answers(bytes(sent))) < sum(m[0] == "request" for m in messages):
            await asyncio.sleep(0.001)
        reader.feed_eof()
        await serving  # ends when the runtime closes, no ProtocolError
        assert _answers(bytes(sent)) == sorted((m[1], m[2]) for m in messages if m[0] == "request")

    run(body())
