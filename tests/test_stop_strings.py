"""Stop strings (notebook 12a's `StopStrings`, notebook 13b's caps): the text cut where the plain `str.find` search cuts it,
token by token, in random completions; a token's search work that does not grow with the number of stop strings;
one index per request, shared by its completions; the offline engine with 10,000 stop strings; and a served request
over a cap refused with an error that names `stop`, the cap and the flag that raises it."""
import asyncio
import inspect
import random
import time
from dataclasses import replace

import pytest

from minivllm import LLM, SamplingParams
from minivllm.outputs import CompletionText, IncrementalDetokenizer, Request, StopStrings
from minivllm.sampling_params import ParamError
from minivllm.serve.async_llm import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, AsyncLLM


class PieceTokenizer:
    "A stand-in tokenizer whose token i decodes to `pieces[i]` (some empty, some ending in an incomplete character)."
    def __init__(self, pieces: list[str]): self.pieces = pieces
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: return "".join(self.pieces[i] for i in ids)


class FindLoopText:
    "The reference: a completion's text followed with every stop string sought by `str.find` after each token."
    def __init__(self, tokenizer, stop: tuple[str, ...], include_stop: bool):
        self.detokenizer, self.stop, self.text, self.include_stop = IncrementalDetokenizer(tokenizer), stop, "", include_stop
        self.hold, self.stopped = max(map(len, stop), default=1) - 1, False

    def add(self, token_ids: list[int], finished: bool = False, look: bool = True) -> bool:
        if self.stopped:
            return True
        start = max(0, len(self.text) - self.hold)
        self.text += self.detokenizer.add(token_ids) + (self.detokenizer.flush() if finished else "")
        found = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0] if look else []
        if found:
            at, length = min(found)
            self.text, self.stopped = self.text[:at + length * self.include_stop], True
        return self.stopped

    def ready(self, finished: bool) -> int:
        return len(self.text) if finished or self.stopped else max(0, len(self.text) - self.hold)


def random_case(rng: random.Random):
    "Stop strings that overlap and are prefixes of each other, token pieces that split them, include_stop, min_tokens."
    alphabet = rng.choice(["ab", "abc\n", "ab\ufffd", "aé"])
    word = lambda longest: "".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest)))
    stop = [word(rng.choice([2, 4, 6, 12])) for _ in range(rng.randint(1, 10))]
    stop += [s[:rng.randint(1, len(s))] for s in stop[:3]]
    pieces = [word(5)[:rng.randint(0, 5)] for _ in range(12)] + ["\ufffd", ""]
    ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 40))]
    return tuple(stop), PieceTokenizer(pieces), ids, rng.random() < 0.5, rng.choice([0, 0, 1, 4, 12])


def shown_per_token(text, ids: list[int], min_tokens: int) -> list[tuple[str, bool]]:
    "What a stream of the completion can give out after each token, and whether it has stopped."
    shown = []
    for n, token in enumerate(ids, 1):
        done = n == len(ids)
        stopped = text.add([token], finished=done, look=n >= min_tokens)
        shown.append((text.text[:text.ready(done or stopped)], stopped))
        if stopped:
            break
    return shown


def test_the_text_is_cut_where_the_find_loop_cuts_it_token_by_token():
    rng, stopped = random.Random(0), 0
    for _ in range(3000):
        stop, tokenizer, ids, include_stop, min_tokens = random_case(rng)
        expected = shown_per_token(FindLoopText(tokenizer, stop, include_stop), ids, min_tokens)
        assert shown_per_token(CompletionText(tokenizer, stop, include_stop), ids, min_tokens) == expected, (stop, ids)
        stopped += expected[-1][1]
    assert 1000 < stopped < 2900  # both kinds of completion are tried


def taken_per_token(text, ids: list[int], min_tokens: int, every: int) -> list[tuple[str, bool]]:
    "What a stream is given (`take`), read after every `every` tokens, each time as the text given so far, and whether it stopped."
    given, shown = "", []
    for n, token in enumerate(ids, 1):
        done = n == len(ids)
        stopped = text.add([token], finished=done, look=n >= min_tokens)
        if stopped or done or n % every == 0:
            given += text.take(done or stopped)
            shown.append((given, stopped))
        if stopped:
            break
    return shown


def test_a_streamed_text_taken_piece_by_piece_is_the_find_loops_text_and_keeps_only_its_end():
    "`take` at every token or every few (a stream's news): all given so far is the reference's text up to its ready point; only the held-back end stays unsettled."
    rng = random.Random(2)
    for _ in range(2000):
        stop, tokenizer, ids, include_stop, min_tokens = random_case(rng)
        every = rng.choice([1, 1, 3])
        ours = CompletionText(tokenizer, stop, include_stop)
        expected = [(text, stopped) for n, (text, stopped) in enumerate(
            shown_per_token(FindLoopText(tokenizer, stop, include_stop), ids, min_tokens), 1)
            if stopped or n == len(ids) or n % every == 0]
        assert taken_per_token(ours, ids, min_tokens, every) == expected, (stop, ids, every)
        assert len(ours.recent) <= ours.hold, (ours.recent, ours.hold)


def test_completions_that_share_one_index_keep_their_own_place():
    rng = random.Random(1)
    for _ in range(500):
        stop, tokenizer, _, include_stop, min_tokens = random_case(rng)
        shared = StopStrings(stop)
        runs = [[rng.randrange(len(tokenizer.pieces)) for _ in range(30)] for _ in range(4)]
        ours = [CompletionText(tokenizer, shared, include_stop) for _ in runs]
        plain = [FindLoopText(tokenizer, stop, include_stop) for _ in runs]
        for step in range(30):  # the n completions of a request, a token each per step, interleaved
            for i, ids in enumerate(runs):
                look = step + 1 >= min_tokens
                assert ours[i].add([ids[step]], look=look) == plain[i].add([ids[step]], look=look)
                assert ours[i].text[:ours[i].ready(False)] == plain[i].text[:plain[i].ready(False)]


def test_a_request_indexes_its_stop_strings_once_for_all_its_completions():
    params = SamplingParams(n=3, stop=["\n\n", "END"], max_tokens=4)
    request = Request("r", None, [1, 2], params, PieceTokenizer(["a"]), stream=False)
    assert len({id(t.stop) for t in request.texts}) == 1 and request.texts[0].stop.stop == ("\n\n", "END")


class CountingDict(dict):
    "A dict that counts its `get` calls."
    calls = 0
    def get(self, key, default=None):
        CountingDict.calls += 1
        return super().get(key, default)


class CountingSet(frozenset):
    "A frozenset that counts its membership tests."
    calls = 0
    def __contains__(self, item):
        CountingSet.calls += 1
        return super().__contains__(item)


def lookups_per_character(stop: list[str], text: str) -> float:
    "Dictionary and set lookups per character of `StopStrings.first` over `text`, a token of 1 to 6 characters at a time."
    stops = StopStrings(stop)
    stops.ends, stops.strings = CountingDict(stops.ends), CountingSet(stops.strings)
    CountingDict.calls = CountingSet.calls = 0
    rng, at = random.Random(0), 0
    while at < len(text):
        new = at + rng.randint(1, 6)
        assert stops.first(text[:new], max(0, at - stops.longest + 1), at) is None
        at = new
    return (CountingDict.calls + CountingSet.calls) / len(text)


LETTERS = "abcdefghijklmnopqrstuvwxyz ,.\n"


def hash_words(rng: random.Random, count: int, lengths) -> list[str]:
    "`count` stop strings of the letters a text is made of, each after a '#', so that none is ever found."
    return ["#" + "".join(rng.choice(LETTERS) for _ in range(rng.choice(lengths) - 1)) for _ in range(count)]


def test_a_tokens_search_does_not_grow_with_the_number_of_stop_strings():
    rng = random.Random(0)
    text = "".join(rng.choice(LETTERS) for _ in range(3000))
    few = hash_words(rng, 10, [85])
    for many in (few + hash_words(rng, 10_000, [85]), few + hash_words(rng, 10_000, range(2, 1001))):
        # at most one lookup per ending of up to `depth` characters, and a set lookup now and then
        assert lookups_per_character(few, text) <= lookups_per_character(many, text) <= StopStrings.depth + 0.5


def time_per_token(stop: tuple[str, ...], tokenizer, ids: list[int], repeats: int = 5) -> float:
    "The least seconds per token, over `repeats` runs, of following a completion's text with `stop`."
    best = float("inf")
    for _ in range(repeats):
        text = CompletionText(tokenizer, stop)
        t = time.perf_counter()
        for token in ids:
            assert not text.add([token])
        best = min(best, (time.perf_counter() - t) / len(ids))
    return best


def test_ten_thousand_stop_strings_cost_a_token_about_what_ten_do():
    rng = random.Random(0)
    tokenizer = PieceTokenizer(["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 6))) for _ in range(500)])
    ids = [rng.randrange(500) for _ in range(300)]
    few = tuple(hash_words(rng, 10, [85]))
    many = few + tuple(hash_words(rng, 10_000, [85]))
    # generous, for a busy machine: they are within 2-4x of each other; a search per stop string is over 100x
    assert time_per_token(many, tokenizer, ids) < 20 * time_per_token(few, tokenizer, ids)


def test_the_offline_engine_takes_ten_thousand_stop_strings():
    rng = random.Random(0)
    junk = hash_words(rng, 10_000, [85])  # no cap offline: its user is the operator
    params = SamplingParams(temperature=0, max_tokens=24)
    with LLM(max_model_len=256) as llm:
        whole = llm.generate("ROMEO.\n", params, use_tqdm=False)[0].text
        stop = whole[8:11]
        cut = llm.generate("ROMEO.\n", replace(params, stop=junk + [stop]), use_tqdm=False)[0]
        streamed = "".join(d.text for d in llm.stream("ROMEO.\n", replace(params, stop=[stop] + junk)))
    assert (cut.text, cut.finish_reason) == (whole[:whole.index(stop)], "stop") and streamed == cut.text


OVER_THE_CAPS = [  # stop strings, and the message that refuses them (a server's 400) with caps of 4 strings of 16 characters
    (["a", "b", "c", "d", "e"], "stop holds 5 strings, but this server takes at most 4 per request: send fewer, or start "
                                "the server with a higher --max-stop-strings (AsyncLLM's max_stop_strings)"),
    (["a", "b" * 17], "stop string 1 has 17 characters, but this server takes stop strings of at most 16: shorten it, or "
                      "start the server with a higher --max-stop-string-chars (AsyncLLM's max_stop_string_chars)"),
]


def test_a_served_request_over_a_cap_is_refused_naming_stop_the_cap_and_the_flag(chat_ckpt):
    async def refused_then_served(engine, params):
        with pytest.raises(ParamError, match="this server takes"):
            await anext(engine.generate("hello", params))
        at_caps = replace(params, stop=["a", "b", "c", "d" * 16], ignore_eos=True)
        return [d async for d in engine.generate("hello", at_caps)]

    with AsyncLLM(chat_ckpt, max_model_len=128, max_stop_strings=4, max_stop_string_chars=16) as engine:
        for stop, message in OVER_THE_CAPS:
            params = SamplingParams(max_tokens=4, stop=stop)
            with pytest.raises(ParamError) as e:
                engine.check("hello", params)
            assert (str(e.value), e.value.param) == (message, "stop")
            deltas = asyncio.run(refused_then_served(engine, params))
            assert deltas[-1].finished and not engine._live


def test_the_caps_default_to_64_stop_strings_of_1024_characters_and_are_checked_at_once(chat_ckpt):
    defaults = inspect.signature(AsyncLLM).parameters
    assert (defaults["max_stop_strings"].default, defaults["max_stop_string_chars"].default) == (64, 1024)
    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS) == (64, 1024)
    for bad in (0, -1, True, 2.5, "8"):
        with pytest.raises(ValueError, match=f"max_stop_strings must be a whole number >= 1, got {bad!r}"):
            AsyncLLM(chat_ckpt, max_stop_strings=bad)  # before any process starts
        with pytest.raises(ValueError, match=f"max_stop_string_chars must be a whole number >= 1, got {bad!r}"):
            AsyncLLM(chat_ckpt, max_stop_string_chars=bad)
