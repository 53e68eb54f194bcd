//! Prometheus metrics, served as text at `GET /metrics`.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// Requests to the model by route and HTTP status.
    pub requests: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// `usage.completion_tokens` of the completion and chat responses that ended whole (a stream
    /// through its last chunk): what clients were billed, as they count it.
    pub completion_tokens: IntCounter,
    /// Requests whose client went away before the response ended (counted by the handler).
    pub cancelled: IntCounter,
    /// Requests ended by the request timeout.
    pub timeouts: IntCounter,
    /// Streams dropped because their client stopped reading for the stream timeout.
    pub stream_timeouts: IntCounter,
    pub queue_depth: IntGauge,
    /// Sequences in the last decode step.
    pub batch_size: IntGauge,
    pub prefix_cache_lookups: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub prefix_cache_reused_tokens: IntCounter,
    pub prefix_cache_bytes: IntGauge,
    /// KV-cache bytes free for the next sequences (`--kv-cache-mib`).
    kv_pool_bytes: IntGauge,
    /// The C heap's live and free bytes, read at each scrape (`gpt::device::heap_usage`).
    heap_allocated_bytes: IntGauge,
    heap_free_bytes: IntGauge,
    /// Times the engine handed the heap's free pages back to the OS after a burst.
    pub heap_trims: IntCounter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    /// Wall time of each engine step (one batch's forward pass and sampling): with the token
    /// counters, how fast the server works apart from how long requests queue.
    pub step_duration: Histogram,
    /// Speculative decoding: steps that checked proposals, tokens proposed, tokens accepted; and
    /// from them (at each check) the share accepted and the tokens accepted per check.
    spec_checks: IntCounter,
    spec_proposed: IntCounter,
    spec_accepted: IntCounter,
    spec_acceptance_rate: Gauge,
    spec_mean_accepted: Gauge,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("gpt_requests_total", "Requests to the model by route and HTTP status"),
            &["route", "status"],
        )?;
        let prompt_tokens = IntCounter::new("gpt_prompt_tokens_total", "Prompt tokens processed")?;
        let generated_tokens = IntCounter::new("gpt_generated_tokens_total", "Tokens generated")?;
        let completion_tokens = IntCounter::new(
            "gpt_completion_tokens_total",
            "usage.completion_tokens of the responses that ended whole",
        )?;
        let cancelled = IntCounter::new(
            "gpt_cancelled_total",
            "Requests whose client went away before the response ended",
        )?;
        let timeouts = IntCounter::new("gpt_request_timeouts_total", "Requests ended by the request timeout")?;
        let stream_timeouts = IntCounter::new(
            "gpt_stream_timeouts_total",
            "Streams dropped because their client stopped reading",
        )?;
        let queue_depth = IntGauge::new("gpt_queue_depth", "Requests waiting for the engine")?;
        let batch_size = IntGauge::new("gpt_batch_size", "Sequences in the latest decode step")?;
        let prefix_cache_lookups = IntCounter::new(
            "gpt_prefix_cache_lookups_total",
            "Prompts looked up in the prefix cache",
        )?;
        let prefix_cache_hits = IntCounter::new("gpt_prefix_cache_hits_total", "Prompts that reused a cached prefix")?;
        let prefix_cache_reused_tokens = IntCounter::new(
            "gpt_prefix_cache_reused_tokens_total",
            "Prompt tokens not prefilled, their KV cache reused",
        )?;
        let prefix_cache_bytes = IntGauge::new("gpt_prefix_cache_bytes", "KV cache bytes held by the prefix cache")?;
        let kv_pool_bytes = IntGauge::new("gpt_kv_pool_bytes", "KV cache bytes free for the next sequences")?;
        let heap_allocated_bytes = IntGauge::new("gpt_heap_allocated_bytes", "C heap bytes in live blocks")?;
        let heap_free_bytes = IntGauge::new(
            "gpt_heap_free_bytes",
            "C heap bytes freed but kept by the allocator (fragmentation)",
        )?;
        let heap_trims = IntCounter::new(
            "gpt_heap_trims_total",
            "Times the engine handed the C heap's free pages back to the OS after a burst",
        )?;
        let latency_buckets = vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ];
        let time_to_first_token = Histogram::with_opts(
            HistogramOpts::new("gpt_time_to_first_token_seconds", "From request queued to first token")
                .buckets(latency_buckets.clone()),
        )?;
        let inter_token_latency = Histogram::with_opts(
            HistogramOpts::new(
                "gpt_inter_token_latency_seconds",
                "Between consecutive tokens of a sequence",
            )
            .buckets(latency_buckets.clone()),
        )?;
        let step_duration = Histogram::with_opts(
            HistogramOpts::new(
                "gpt_step_duration_seconds",
                "Wall time of one engine step: a batch's forward pass and sampling",
            )
            .buckets(latency_buckets),
        )?;
        let spec_checks = IntCounter::new(
            "gpt_spec_decode_checks_total",
            "Speculative decoding: sequence steps that checked proposed tokens",
        )?;
        let spec_proposed = IntCounter::new(
            "gpt_spec_decode_draft_tokens_total",
            "Speculative decoding: tokens proposed (n-gram or draft model)",
        )?;
        let spec_accepted = IntCounter::new(
            "gpt_spec_decode_accepted_tokens_total",
            "Speculative decoding: proposed tokens the model accepted",
        )?;
        let spec_acceptance_rate = Gauge::new(
            "gpt_spec_decode_acceptance_rate",
            "Speculative decoding: accepted / proposed tokens since the start",
        )?;
        let spec_mean_accepted = Gauge::new(
            "gpt_spec_decode_mean_accepted_length",
            "Speculative decoding: proposed tokens accepted per check since the start (each check also adds one token of the model's)",
        )?;
        for c in [&spec_checks, &spec_proposed, &spec_accepted] {
            registry.register(Box::new(c.clone()))?;
        }
        registry.register(Box::new(spec_acceptance_rate.clone()))?;
        registry.register(Box::new(spec_mean_accepted.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(generated_tokens.clone()))?;
        registry.register(Box::new(completion_tokens.clone()))?;
        registry.register(Box::new(cancelled.clone()))?;
        registry.register(Box::new(timeouts.clone()))?;
        registry.register(Box::new(stream_timeouts.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(batch_size.clone()))?;
        registry.register(Box::new(prefix_cache_lookups.clone()))?;
        registry.register(Box::new(prefix_cache_hits.clone()))?;
        registry.register(Box::new(prefix_cache_reused_tokens.clone()))?;
        registry.register(Box::new(prefix_cache_bytes.clone()))?;
        registry.register(Box::new(kv_pool_bytes.clone()))?;
        registry.register(Box::new(heap_allocated_bytes.clone()))?;
        registry.register(Box::new(heap_free_bytes.clone()))?;
        registry.register(Box::new(heap_trims.clone()))?;
        registry.register(Box::new(time_to_first_token.clone()))?;
        registry.register(Box::new(inter_token_latency.clone()))?;
        registry.register(Box::new(step_duration.clone()))?;
        Ok(Self {
            registry,
            requests,
            prompt_tokens,
            generated_tokens,
            completion_tokens,
            cancelled,
            timeouts,
            stream_timeouts,
            queue_depth,
            batch_size,
            prefix_cache_lookups,
            prefix_cache_hits,
            prefix_cache_reused_tokens,
            prefix_cache_bytes,
            kv_pool_bytes,
            heap_allocated_bytes,
            heap_free_bytes,
            heap_trims,
            time_to_first_token,
            inter_token_latency,
            step_duration,
            spec_checks,
            spec_proposed,
            spec_accepted,
            spec_acceptance_rate,
            spec_mean_accepted,
        })
    }

    /// A sequence's check of `proposed` tokens, `accepted` of them kept.
    /// Speculative decoding's checks so far and the proposed tokens they accepted.
    pub fn speculation_totals(&self) -> (u64, u64) {
        (self.spec_checks.get(), self.spec_accepted.get())
    }

    pub fn record_speculation(&self, proposed: usize, accepted: usize) {
        self.spec_checks.inc();
        self.spec_proposed.inc_by(proposed as u64);
        self.spec_accepted.inc_by(accepted as u64);
        let (checks, proposed, accepted) = (
            self.spec_checks.get() as f64,
            self.spec_proposed.get() as f64,
            self.spec_accepted.get() as f64,
        );
        self.spec_acceptance_rate.set(accepted / proposed.max(1.0));
        self.spec_mean_accepted.set(accepted / checks.max(1.0));
    }

    /// Counts kept elsewhere (the structured outputs' grammar cache), exposed here too.
    pub fn register(&self, collectors: Vec<Box<dyn prometheus::core::Collector>>) -> prometheus::Result<()> {
        collectors.into_iter().try_for_each(|c| self.registry.register(c))
    }

    /// The Prometheus text exposition format.
    pub fn render(&self) -> String {
        self.kv_pool_bytes.set(gpt::kv_pool_bytes() as i64);
        if let Some(heap) = gpt::device::heap_usage() {
            self.heap_allocated_bytes.set(heap.allocated as i64);
            self.heap_free_bytes.set(heap.free as i64);
        }
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
