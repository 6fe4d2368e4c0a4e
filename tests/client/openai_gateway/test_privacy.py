"""Behind the gateway, each API key's prompts stay its own: the gateway tells the daemon which
key a request came with (a hash, never the key), and a prompt one key's user sent is not in the
prefix cache for another key's; each key's repeat still starts from its own."""

from __future__ import annotations

import re

import openai
import pytest

from ntx_client.openai_gateway.app import key_id

KEYS = ("sk-test-alice", "sk-test-bob")
PROMPT = "Kettle. The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud."


@pytest.fixture(scope="module")
def stack(processes):
    DaemonProcess, GatewayProcess = processes
    d = DaemonProcess("--max-batch", "4", "--max-ctx", "512")
    g = None
    try:
        d.wait_ready()
        g = GatewayProcess("--socket", d.socket, api_key=KEYS[0], more_keys=KEYS[1:]).wait_ready()
        yield d, g
    finally:
        if g is not None:
            g.stop()
        d.cleanup()


def test_two_api_keys_do_not_share_the_prefix_cache(stack):
    _, g = stack
    alice, bob = (openai.OpenAI(base_url=g.url, api_key=k, max_retries=0, timeout=120) for k in KEYS)
    model = alice.models.list().data[0].id

    def cached(client) -> tuple[int, int, str]:
        r = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens, r.choices[0].text
    a1, b1, a2, b2 = cached(alice), cached(bob), cached(alice), cached(bob)
    n = a1[1]
    assert [a1[0], b1[0], a2[0], b2[0]] == [0, 0, n - 1, n - 1]
    assert a1[2] == b1[2] == a2[2] == b2[2]


def test_a_key_id_names_the_key_without_showing_it():
    ids = [key_id(k.encode()) for k in KEYS]
    assert ids[0] != ids[1] and ids[0] == key_id(KEYS[0].encode())  # one id per key, the same each time
    for k, i in zip(KEYS, ids):
        assert re.fullmatch(r"key:[0-9a-f]{24}", i) and k not in i and k.removeprefix("sk-") not in i
