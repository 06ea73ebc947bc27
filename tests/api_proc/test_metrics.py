"""GET /metrics of a real `pagoda serve`: vLLM's metric names, and values that move by exactly what the
requests did (the usage the API returned, one count per sample, gauges back to zero afterwards)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from tests.metrics_scrape import Scrape, delta, scrape_until

VLLM_METRICS = {  # name -> type, as vLLM exports them
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
PER_SAMPLE_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
]
LONG_PROMPT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " * 3


def test_vllm_names_types_labels_and_every_process(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)  # every series exists now
    scrape = Scrape(server)
    assert scrape.content_type.startswith("text/plain")
    for name, kind in VLLM_METRICS.items():
        assert scrape.families[name].type == kind, name
        for sample in scrape.families[name].samples:
            assert sample.labels["model_name"] == MODEL_NAME and sample.labels["engine"] == "0", sample
    reasons = {s.labels["finished_reason"] for s in scrape.families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    ttft_buckets = [
        s.labels["le"]
        for s in scrape.families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-2:] == ["2560.0", "+Inf"]
    assert {s.labels["status_code"] for s in scrape.families["pagoda:request_rejected"].samples} == {"413", "429"}
    # Told apart by role and index, never by pid: the public /metrics names no process id.
    processes = [s.labels for s in scrape.families["process_cpu_seconds"].samples]
    assert sorted(processes, key=lambda labels: labels["process"]) == [
        {"process": "api", "index": "0"},
        {"process": "detok", "index": "0"},
        {"process": "engine", "index": "0"},
    ]
    pids = {str(pid) for pid in [server.process.pid, *server.children()]}
    assert not [s for s in scrape.samples if pids & set(s.labels.values())]
    assert all(s.value > 0 for s in scrape.families["process_resident_memory_bytes"].samples)


def test_counters_and_histograms_move_by_what_the_requests_returned(server, client):
    before = Scrape(server)
    samples = []  # (finish_reason, prompt_tokens, completion_tokens) per sample
    usages = []  # (usage, n) per request
    batch = client.completions.create(
        model=MODEL_NAME,
        prompt="Name a colour:",
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    usages.append((batch.usage, 2))
    samples += [c.finish_reason for c in batch.choices]
    for _ in range(2):  # the second one finds the first one's prompt blocks in the prefix cache
        single = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
        usages.append((single.usage, 1))
        samples.append(single.choices[0].finish_reason)
    assert single.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usages.append((chunks[-1].usage, 1))
    samples += [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    after = Scrape(server)

    num_samples = len(samples)
    assert {"stop", "length"} <= set(samples)  # the chat answer ends by EOS, the completions by max_tokens
    for reason in ("stop", "length", "abort"):
        assert delta(before, after, "vllm:request_success_total", finished_reason=reason) == samples.count(reason)
    prompt_tokens = sum(u.prompt_tokens * n for u, n in usages)  # each sample prefills the prompt
    generation_tokens = sum(u.completion_tokens for u, _ in usages)
    assert delta(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "vllm:generation_tokens_total") == generation_tokens
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta(before, after, "vllm:request_generation_tokens_sum") == generation_tokens
    for name in PER_SAMPLE_HISTOGRAMS:
        assert delta(before, after, name + "_count") == num_samples, name
    # One token per engine step and sample: every token after a sample's first is one inter-token gap.
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == generation_tokens - num_samples
    # Every sample looked its prompt up once (none was preempted); the hits are the cached tokens the API
    # reported (the n=2 prompt is shorter than a block, so its samples cannot hit).
    assert delta(before, after, "vllm:num_preemptions_total") == 0
    assert delta(before, after, "vllm:prefix_cache_queries_total") == prompt_tokens
    assert (
        delta(before, after, "vllm:prefix_cache_hits_total")
        == sum(u.prompt_tokens_details.cached_tokens for u, _ in usages)
        > 0
    )
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after.value(gauge) == 0, gauge


def test_client_disconnect_counts_as_abort_and_frees_everything(server, client):
    before = Scrape(server)
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Tell me a long story.", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # generating now: the first token has come
    running = Scrape(server)
    assert running.value("vllm:num_requests_running") == 1 and running.value("vllm:kv_cache_usage_perc") > 0
    stream.close()  # the client goes away mid-response

    after = scrape_until(
        server,
        lambda s: (
            delta(before, s, "pagoda:request_aborted_total") == 1
            and delta(before, s, "vllm:request_success_total", finished_reason="abort") == 1
            and s.value("vllm:num_requests_running") == 0
            and s.value("vllm:kv_cache_usage_perc") == 0
        ),
    )
    assert delta(before, after, "pagoda:request_aborted_total") == 1
    assert delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "vllm:request_success_total") == 1  # as "abort" only
    assert after.value("vllm:num_requests_running") == 0 and after.value("vllm:num_requests_waiting") == 0
    assert after.value("vllm:kv_cache_usage_perc") == 0
    generated = delta(before, after, "vllm:generation_tokens_total")
    assert 1 <= generated < 1000
    assert delta(before, after, "vllm:request_generation_tokens_sum") == generated
    for name in PER_SAMPLE_HISTOGRAMS:  # the aborted sample had its first token, so it has every one
        assert delta(before, after, name + "_count") == 1, name
    assert delta(before, after, "pagoda:request_rejected_total") == 0
    assert delta(before, after, "pagoda:request_timeout_total") == 0


def test_a_flood_of_scrapes_renders_once_per_interval_and_generation_goes_on(start_server):
    """/metrics is public by default, and a flood of it once starved generation: the tokenizer process
    rendered every scrape in its request loop. Now every scrape of one interval (here an hour, so the whole
    flood is one interval) gets the same text, rendered once, and a completion sent into the flood is
    answered."""
    server = start_server("--metrics-interval", "3600")
    with ThreadPoolExecutor(32) as pool:
        scrapes = [pool.submit(http, "GET", server.base_url + "/metrics") for _ in range(200)]
        completion = pool.submit(
            http, "POST", server.base_url + "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
        )
        bodies = {future.result()[1] for future in scrapes}
    assert completion.result()[0] == 200
    assert len(bodies) == 1, len(bodies)  # one text: the same render for all
    (text,) = bodies
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert [s.value for s in samples if s.name == "pagoda:metrics_renders_total"] == [1]
