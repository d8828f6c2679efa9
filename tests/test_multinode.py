"""Tensor-parallel ranks on two machines (notebook 10a): two `minivllm worker`-joined "hosts" on one machine give the
tokens of TP=1 and of one host; a host that disappears is named in a `RankFailure`, and nothing is left behind.
Where root and `ip netns` allow, the second host lives in its own network namespace with its own /dev/shm.
What crosses the machines is authenticated with the cluster's secret: a store client without it can neither run
code on a worker, nor stop the engine, nor take a node's place."""
from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
import threading
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.cli import main as cli_main
from minivllm.distributed import RankFailure, free_port, listen_socket
from minivllm.cluster.wire import SECRET_ENV, new_secret
from minivllm.testing import (WorkerNode, gone, leftover_segments, make_tiny_checkpoint, rank_processes, rss_mib,
                              shm_segments, tcp_listeners, wait_until)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60))]


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch):
    "Every machine of an engine holds the same secret (here: this process, and the workers and servers it starts)."
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    return secret


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tie_word_embeddings=True)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def on_two_hosts(model, tp: int, prompts=PROMPTS, params=GREEDY, master_addr="127.0.0.1", prefix=(), ns=None, **kwargs):
    "The tokens of an engine of `tp` ranks over two hosts (the second a `WorkerNode`), the node's exit code, and every rank's TCP listeners."
    port = free_port(master_addr)
    with WorkerNode(master_addr, port, prefix=prefix) as node:
        with LLM(model, tensor_parallel_size=tp, nnodes=2, master_addr=master_addr, master_port=port, **kwargs) as llm:
            assert llm.llm_engine.remote is not None and len(node.ranks) == tp // 2
            local = [os.getpid(), *(p.pid for p in llm.llm_engine.channel.processes.values())] if llm.llm_engine.channel is not None else [os.getpid()]
            listening = tcp_listeners(local) + tcp_listeners(node.ranks, ns)
            out = tokens(llm, prompts, params)
    return out, node.wait(), listening


@pytest.mark.parametrize("model, tp", [("tiny", 4), ("tiny_llama", 2)])
def test_two_hosts_give_the_tokens_of_one(model, tp, request):
    path = request.getfixturevalue(model)
    with LLM(path) as llm:
        reference = tokens(llm)
    with LLM(path, tensor_parallel_size=tp) as llm:
        assert tokens(llm) == reference
    before = shm_segments()
    got, code, listening = on_two_hosts(path, tp)
    assert got == reference
    assert code == 0
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
    assert not leftover_segments(before)


def test_the_packaged_model_on_two_hosts():
    "In float32, whose greedy tokens do not depend on the torch version (bfloat16 sums round differently by TP size)."
    prompts, params = ["ROMEO:", "To be, or not", "The king"], SamplingParams(temperature=0.0, max_tokens=24)
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)  # the prefill's top-5 log-probabilities
    with LLM(dtype="float32") as llm:
        # eight prompts of 1,000 tokens of the model's own text: their prefill's command needs two broadcasts
        written = llm.generate(["ROMEO:", "JULIET:", "HAMLET:", "First Citizen:", "KING:", "Enter", "QUEEN:", "Exeunt"],
                               SamplingParams(temperature=1.0, seed=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
        long_prompts = [o.prompt_token_ids + o.token_ids for o in written]
        reference = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
        long_reference = top_logprobs(llm, long_prompts, first)
    with LLM(tensor_parallel_size=4, dtype="float32") as llm:
        assert [o.text for o in llm.generate(prompts, params, use_tqdm=False)] == reference
        one_host = top_logprobs(llm, long_prompts, first)
    assert_same_logprobs(one_host, long_reference, FLOAT32)
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.engine.step import StepInputs
    from minivllm.cluster.multinode import INLINE_BYTES
    from minivllm.cluster.wire import CommandCodec
    n = len(long_prompts)
    prefill = StepInputs.build(True, long_prompts, [0] * n, [list(range(63))] * n, block_size=16)
    assert len(CommandCodec(ModelRunner.COMMANDS).encode("run", prefill)) > INLINE_BYTES
    from minivllm.model_source import DEFAULT_MODEL
    port = free_port()
    with WorkerNode("127.0.0.1", port) as node:
        with LLM(DEFAULT_MODEL, tensor_parallel_size=4, nnodes=2, master_port=port, dtype="float32") as llm:
            assert [o.text for o in llm.generate(prompts, params, use_tqdm=False)] == reference
            two_hosts = top_logprobs(llm, long_prompts, first)
    assert_same_logprobs(two_hosts, long_reference, FLOAT32)
    assert two_hosts == one_host  # bit for bit: the same shards and the same sums, whatever carries the commands
    assert node.wait() == 0


def top_logprobs(llm, prompts, params) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}
            for o in llm.generate(prompts, params, use_tqdm=False)]


FLOAT32 = dict(atol=1e-3, rtol=1e-3)  # TP changes the order of the sums


def assert_same_logprobs(got: list[dict[int, float]], expected: list[dict[int, float]], tolerance: dict) -> None:
    "The same top tokens (all but a near-tie at the edge) with log-probabilities close within `tolerance`."
    import torch
    for g, e in zip(got, expected, strict=True):
        common = sorted(g.keys() & e.keys())
        assert len(common) >= len(e) - 1, (g, e)
        torch.testing.assert_close(torch.tensor([g[t] for t in common]), torch.tensor([e[t] for t in common]),
                                   **tolerance)


@pytest.mark.parametrize("what", ["host", "ranks"])
def test_a_host_that_disappears_is_named(tiny, what):
    "Kill the second host (its agent and ranks at once) or only its ranks during generate: a RankFailure names rank 2 and its node."
    before = shm_segments()
    port = free_port()
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with WorkerNode("127.0.0.1", port) as node:
        llm = LLM(tiny, tensor_parallel_size=4, nnodes=2, master_port=port)
        local, remote = [p.pid for p in llm.llm_engine.channel.processes.values()], node.ranks
        assert len(remote) == 2

        def take_it_away():
            if what == "host":
                node.kill()
            else:
                for pid in remote: os.kill(pid, 9)
        with pytest.raises(RankFailure, match=r"rank [23] on node 1 \(") as failure:
            for i, _ in enumerate(llm.stream([[1, 2, 3]] * 4, params)):
                if i == 8:  # two steps in: mid-generation whatever the machine's speed
                    start = time.monotonic()
                    take_it_away()
        took = time.monotonic() - start
        expected = "has not been heard from" if what == "host" else "died with exit code -9 \\(killed by SIGKILL\\)"
        assert failure.match(expected)
        assert llm.llm_engine.closed
        assert took < 30, took
        assert node.wait() != 0
    for pid in local + remote:
        assert wait_gone(pid), f"pid {pid} is still running"
    assert not leftover_segments(before)
    with LLM(tiny) as llm:  # the process is still usable
        assert tokens(llm, [[1, 2, 3]])


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    return wait_until(lambda: gone(pid), timeout_s)


def group_gone(pgid: int) -> bool:
    "No process is left in process group `pgid` (a `WorkerNode` runs in its own)."
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_remote_ranks_exit_when_the_engine_dies(tiny):
    "rank 0's process killed: the other host's ranks notice its store is gone, and the agent ends within seconds, saying so in one line."
    port = free_port()
    script = (f"from minivllm import LLM; llm = LLM({str(tiny)!r}, tensor_parallel_size=2, nnodes=2, master_port={port}); "
              "print('up', flush=True); import time; time.sleep(600)")
    with WorkerNode("127.0.0.1", port) as node:
        engine = subprocess.Popen([os.sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert engine.stdout.readline().strip() == "up"
        remote = node.ranks
        engine.kill()
        engine.wait()
        start = time.monotonic()
        assert node.wait(60) != 0
        took = time.monotonic() - start
    for pid in remote:
        assert wait_gone(pid)
    assert took < 15, took  # within seconds, and in one line: no C++ stack, no traceback per rank
    after_start = [line for line in node.log if line.strip()][1:]
    assert len(after_start) == 1 and "the engine at 127.0.0.1:" in after_start[0] and "is gone" in after_start[0], node.log


def test_bad_multi_host_inputs_are_one_line_errors(tiny, capsys):
    cases = [(["generate", "hi", "--tp", "2", "--nnodes", "4"], "does not split evenly over nnodes=4"),
             (["generate", "hi", "--tp", "2", "--nnodes", "2", "--master-addr", "192.0.2.1"], "cannot listen on 192.0.2.1"),
             (["worker", "--master-addr", "127.0.0.1", "--master-port", "1", "--node-rank", "0"], "node 0 is the engine's"),
             (["worker", "--master-addr", "127.0.0.1", "--master-port", "0", "--node-rank", "1"], "--master-port must be"),
             (["worker", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--node-rank", "1",
               "--timeout", "1"], "no engine answered at 127.0.0.1:")]
    for argv, message in cases:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    for secret, message in ((None, f"set {SECRET_ENV} to the engine's cluster secret"), ("short", "at least 16 characters")):
        with pytest.MonkeyPatch.context() as env:
            env.delenv(SECRET_ENV) if secret is None else env.setenv(SECRET_ENV, secret)
            assert cli_main(["worker", "--master-addr", "127.0.0.1", "--master-port", "1", "--node-rank", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_node_rank_past_nnodes_or_taken_twice_is_refused(tiny):
    port = free_port()
    with WorkerNode("127.0.0.1", port, 2) as wrong, WorkerNode("127.0.0.1", port, 1) as right, \
            WorkerNode("127.0.0.1", port, 1) as twice:
        llm_error = []
        def engine():
            try:
                with LLM(tiny, tensor_parallel_size=2, nnodes=2, master_port=port) as llm:
                    tokens(llm, [[1, 2, 3]])
            except Exception as e:  # pragma: no cover - the test fails below
                llm_error.append(e)
        t = threading.Thread(target=engine)
        t.start()
        t.join(120)
        assert not llm_error, llm_error
        assert wrong.wait() == 2 and "node rank 2 is outside 0..1" in "\n".join(wrong.log)
        codes = sorted([right.wait(), twice.wait()])
        assert codes == [0, 2], codes
        assert any("has already joined" in line for line in right.log + twice.log)


# ---- two hosts that share no loopback and no /dev/shm: a network namespace joined by a veth pair ----

def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")):
        return False
    name = f"mvprobe{secrets.token_hex(3)}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@contextlib.contextmanager
def second_host():
    "A network namespace joined to this one by a veth pair: (this side's address, the command prefix that runs in it with its own /dev/shm)."
    tag = secrets.token_hex(3)
    ns, here, there = f"mv{tag}", f"mva{tag}", f"mvb{tag}"
    subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)
    try:
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        run("ip", "link", "set", there, "netns", ns)
        run("ip", "addr", "add", f"{subnet}.1/24", "dev", here)
        run("ip", "link", "set", here, "up")
        for cmd in (["ip", "addr", "add", f"{subnet}.2/24", "dev", there], ["ip", "link", "set", there, "up"],
                    ["ip", "link", "set", "lo", "up"]):
            run("ip", "netns", "exec", ns, *cmd)
        # subtle: `ip netns exec` gives the command its own mount namespace; a fresh tmpfs on /dev/shm there
        prefix = ("ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                  'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"')
        yield f"{subnet}.1", prefix, ns
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and `ip netns` (network namespaces)")
def test_two_hosts_in_two_network_namespaces(tiny):
    with LLM(tiny) as llm:
        reference = tokens(llm)
    before = shm_segments()
    with second_host() as (address, prefix, ns):
        got, code, listening = on_two_hosts(tiny, 4, master_addr=address, prefix=prefix, ns=ns)
    assert got == reference and code == 0
    # every listener of node 0 (this namespace) and of node 1 (its own) is on the veth pair: none on every interface
    subnet = address.rsplit(".", 1)[0] + "."
    assert listening and all(a.startswith(subnet) for a in listening), listening
    assert not leftover_segments(before)


def test_serving_from_two_hosts():
    "`minivllm serve --nnodes 2` with a `minivllm worker`: the API answers as one host does; SIGTERM ends both."
    import httpx
    from minivllm.bench.workload import ServerProcess
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(dtype="float32") as llm:
        expected = llm.generate("ROMEO:", params, use_tqdm=False)[0].text
    port = free_port()
    with WorkerNode("127.0.0.1", port) as node:
        with ServerProcess("--tp", "2", "--nnodes", "2", "--master-port", str(port), "--dtype", "float32") as server:
            reply = httpx.post(server.url + "/v1/completions", timeout=60,
                               json={"model": "minivllm-default", "prompt": "ROMEO:", "max_tokens": 16, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected
        assert node.wait() == 0


def test_an_engine_whose_nodes_never_come_says_which(tiny):
    "No `minivllm worker` for node 1: after timeout_s the engine names the node and the command that brings it."
    before = shm_segments()
    port = free_port()
    with pytest.raises(RankFailure, match=r"(?s)joined.*node 1 never joined; on each, run `minivllm worker --master-addr "
                                          rf"127\.0\.0\.1 --master-port {port} --node-rank N`"):
        LLM(tiny, tensor_parallel_size=4, nnodes=2, master_port=port, timeout_s=5)
    assert not leftover_segments(before)
    listen_socket("127.0.0.1", port).close()  # the rendezvous let go of its port
    with LLM(tiny) as llm:
        assert tokens(llm, [[1, 2, 3]])  # the process is still usable


@pytest.mark.parametrize("tp", [2, 4])
def test_a_machine_whose_checkpoint_is_broken_is_named(tiny, tmp_path, tp):
    "The second machine's copy of the weights is damaged: the engine's start raises a RankFailure with that rank's own error, and nothing is left on either machine."
    broken = tmp_path / "copy"
    shutil.copytree(tiny, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a checkpoint")
    before = shm_segments()
    port = free_port()
    start = time.monotonic()
    with WorkerNode("127.0.0.1", port, 1, "--model", str(broken)) as node:
        with pytest.raises(RankFailure, match=rf"rank [{tp // 2}-{tp - 1}] on node 1 \(.*\) raised") as failure:
            LLM(tiny, tensor_parallel_size=tp, nnodes=2, master_port=port)
        assert node.wait() != 0
    assert wait_until(lambda: group_gone(node.proc.pid), 15)  # the agent and every rank of the second machine
    assert rank_processes(os.getpid()) == []                   # and the first machine's own rank
    assert f"{broken / 'model.safetensors'} is corrupt or incomplete" in str(failure.value), failure.value
    assert time.monotonic() - start < 60
    assert not leftover_segments(before)
    with LLM(tiny) as llm:  # the process is still usable
        assert tokens(llm, [[1, 2, 3]])


# ---- a store client without the secret (anyone who reaches rank 0's port) ----

def start_engine(model, port: int, **kwargs):
    "An `LLM(..., nnodes=2)` being built in a thread (it waits for node 1): the thread, and a dict that gets 'llm' or 'error'."
    out = {}
    def build():
        try:
            out["llm"] = LLM(model, tensor_parallel_size=2, nnodes=2, master_port=port, **kwargs)
        except Exception as e:
            out["error"] = e
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    return thread, out


def reference_then_engine_waiting_for_node_1(model):
    "The greedy tokens of a one-machine engine, then `start_engine` on a free port: (tokens, port, thread, out)."
    with LLM(model) as llm:
        reference = tokens(llm)
    port = free_port()
    return (reference, port, *start_engine(model, port))


def stranger(port: int):
    "A plain store client of rank 0's rendezvous, once the engine has published its arguments."
    import torch.distributed as dist
    assert wait_until(lambda: _listening(port), 60)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    assert wait_until(lambda: client.check(["engine/args"]), 60)
    return client


def _listening(port: int) -> bool:
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Canary:
    "A pickle that, loaded, creates the file `path` (an attacker's would run any code)."
    def __init__(self, path): self.path = str(path)
    def __reduce__(self): return (open, (self.path, "w"))


def test_a_store_client_cannot_run_code_on_a_worker(tiny, tmp_path):
    "The engine's arguments replaced by a pickle in the store: the worker refuses them in one line, runs nothing, and the engine's start fails clearly."
    import pickle
    before = shm_segments()
    canary = tmp_path / "canary"
    port = free_port()
    thread, out = start_engine(tiny, port, timeout_s=20)
    client = stranger(port)
    client.set("engine/args", pickle.dumps(Canary(canary)))
    with WorkerNode("127.0.0.1", port) as node:
        assert node.wait() == 2
    assert not canary.exists()
    assert any("'engine/args' from the engine at 127.0.0.1" in line and "fails authentication" in line
               for line in node.log), node.log
    assert len([line for line in node.log if line.strip()]) == 1, node.log  # one line, no traceback
    thread.join(120)
    assert isinstance(out.get("error"), RankFailure) and "node 1 never joined" in str(out["error"]), out
    assert not canary.exists()
    assert not leftover_segments(before)


def test_a_store_client_can_neither_stop_the_engine_nor_take_a_node(tiny, cluster_secret):
    "A stranger squats node 1 and a worker with another secret is refused, the right worker joins; then the store is closed, and forged frames at the heartbeat port change nothing."
    reference, port, thread, out = reference_then_engine_waiting_for_node_1(tiny)
    client = stranger(port)
    client.set("node/1", "taken by a stranger")
    with WorkerNode("127.0.0.1", port, prefix=("env", f"{SECRET_ENV}={new_secret()}")) as impostor:
        assert impostor.wait() == 2
    assert any("fails authentication" in line and SECRET_ENV in line for line in impostor.log), impostor.log
    with WorkerNode("127.0.0.1", port) as node:
        thread.join(120)
        assert "llm" in out, out
        with out["llm"] as llm:
            assert not _listening(port)  # the store is gone once the ranks have started: nobody can write to it
            monitor = llm.llm_engine.remote.monitor
            send_as_stranger(monitor.port, frame(b"e", 1, b"injected by an outside client"))
            send_as_stranger(monitor.port, frame(b"w", 1, b"rank 1 on the stranger's machine"))
            long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
            for i, _ in enumerate(llm.stream([[1, 2, 3]], long)):
                send_as_stranger(monitor.port, frame(b"b", 1, b"garbage!"))  # every step, a pulse that is not rank 1's
                llm.llm_engine.remote.check(now=True)       # what every wait on the other machines does: no RankFailure
            assert tokens(llm) == reference
            assert monitor.where(1).startswith("rank 1 on node 1 (")  # not the stranger's name for it
            assert {"error/1", "where/1", "beat/1"} <= monitor.forged
        assert node.wait() == 0


def frame(kind: bytes, rank: int, data: bytes) -> bytes:
    "A heartbeat frame as a stranger makes it: the right head, an unsigned body (a tag of zeros)."
    from minivllm.cluster.multinode import _FRAME
    body = bytes(32) + data
    return _FRAME.pack(kind, rank, len(body)) + body


def send_as_stranger(port: int, data: bytes) -> None:
    "Connect to 127.0.0.1:`port` without the secret, send `data`, and see the connection dropped."
    import socket
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(data)
            s.settimeout(10)
            assert s.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):  # dropped before all of it was read
            pass


def test_across_machines_a_flood_while_serving_leaves_the_engine_flat(tiny):
    "The trust probe's flood (150 values of 4 MiB: 700 -> 1,308 MiB across two machines): the store refuses it, the heartbeat port keeps none of it."
    reference, port, thread, out = reference_then_engine_waiting_for_node_1(tiny)
    with WorkerNode("127.0.0.1", port) as node:
        thread.join(120)
        assert "llm" in out, out
        with out["llm"] as llm:
            assert tokens(llm) == reference
            before = rss_mib(os.getpid())
            assert not _listening(port)
            junk = frame(b"e", 1, os.urandom(4 << 20))  # one buffer, sent 150 times: this process allocates no more
            for _ in range(150):
                send_as_stranger(llm.llm_engine.remote.monitor.port, junk)
            after = rss_mib(os.getpid())
            assert after - before < 20, (before, after)
            assert tokens(llm) == reference
        assert node.wait() == 0


@pytest.mark.parametrize("forged", ["garbage", "node 0 (vm) 999999"])
def test_a_forged_joined_value_is_ignored_and_the_start_completes_with_the_real_worker(tiny, forged):
    "A stranger writes rank 1's `joined/1` before the worker joins (the probe's crash, and its 'rank 1 (pid 999999) died'): ignored with one warning."
    reference, port, thread, out = reference_then_engine_waiting_for_node_1(tiny)
    stranger(port).set("joined/1", forged)
    with WorkerNode("127.0.0.1", port) as node:
        thread.join(120)
        assert "llm" in out, out
        with out["llm"] as llm:
            assert tokens(llm) == reference
        assert node.wait() == 0
