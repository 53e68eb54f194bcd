//! Prefix caching: the KV caches of recent prompts, kept in a memory-bounded LRU store, so that a
//! request whose prompt starts like an earlier one (a system prompt, few-shot examples, the
//! shared context of multiple-choice questions) prefills only what differs.
//!
//! An entry is a prompt's tokens with a copy of its KV cache and, when the prompt was prefilled
//! for `echo` with `logprobs`, the log-probability of each of its tokens with the top `k`
//! alternatives. A lookup takes the entry sharing the longest prefix with the new prompt and
//! copies that many positions into a fresh cache. At least one prompt token is always left to
//! prefill (its logits are what the first token is sampled from); a request that wants the
//! prompt's log-probabilities also needs the stored ones, so it reuses one position less than
//! the common prefix (the logprob of the token after the reused positions was computed from
//! them) and only entries stored with at least its `k`.
//!
//! A request with a `cache_salt` shares entries only with requests of the same salt (vLLM's
//! defence against guessing other users' prompts from time to first token), and a request for a
//! LoRA adapter only with requests for the same adapter (its keys and values are not the base's):
//! the entry's [`Scope`].
//!
//! Plain data and a linear scan: tens of entries at most fit the memory bound at this project's
//! model sizes, against a prefill that takes milliseconds per token.

use gpt::KvCache;

use super::runner::PositionLogprob;

/// Which requests may share an entry: those for the same adapter (by its id; `None`: the base)
/// with the same `cache_salt`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    pub adapter: Option<u64>,
    pub salt: Option<String>,
}

struct Entry {
    tokens: Vec<u32>,
    cache: KvCache,
    /// `(k, logprobs)`: `logprobs[t]` is for token `t + 1`, with the top `k` alternatives.
    logprobs: Option<(usize, Vec<PositionLogprob>)>,
    scope: Scope,
    last_used: u64,
}

/// A reused prefix: a cache holding its first `len` positions, and for a request that wants
/// them, the logprobs of tokens `1..=len`.
pub struct Hit {
    pub cache: KvCache,
    pub len: usize,
    pub logprobs: Vec<PositionLogprob>,
}

pub struct PrefixStore {
    entries: Vec<Entry>,
    capacity_bytes: usize,
    bytes_per_token: usize,
    used_bytes: usize,
    clock: u64,
}

impl PrefixStore {
    /// A store of at most `capacity_bytes` of KV cache (`bytes_per_token` each position); 0
    /// turns prefix caching off.
    pub fn new(capacity_bytes: usize, bytes_per_token: usize) -> Self {
        Self {
            entries: Vec::new(),
            capacity_bytes,
            bytes_per_token: bytes_per_token.max(1),
            used_bytes: 0,
            clock: 0,
        }
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// How many positions of `entry` a prompt may reuse (see the module's notes).
    fn usable(entry: &Entry, prompt: &[u32], top_k: Option<usize>, scope: &Scope) -> usize {
        if &entry.scope != scope {
            return 0;
        }
        let common = entry.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let most = common.min(prompt.len().saturating_sub(1));
        let n = match (top_k, &entry.logprobs) {
            (None, _) => most,
            (Some(k), Some((stored_k, _))) if *stored_k >= k => most.min(common.saturating_sub(1)),
            (Some(_), _) => 0,
        };
        // A sliding window may have given back what a shorter prefix would need.
        if n < entry.cache.shortest_prefix() {
            return 0;
        }
        n
    }

    /// The longest stored prefix of `prompt`, copied into a fresh cache; `top_k` when the
    /// prompt's own logprobs are wanted (with that many alternatives); only entries stored with
    /// the same `scope`.
    pub fn lookup(&mut self, prompt: &[u32], top_k: Option<usize>, scope: &Scope) -> candle_core::Result<Option<Hit>> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, Self::usable(e, prompt, top_k, scope)))
            .max_by_key(|&(_, n)| n);
        let Some((i, len)) = best.filter(|&(_, n)| n > 0) else {
            return Ok(None);
        };
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.last_used = self.clock;
        let logprobs = match (top_k, &entry.logprobs) {
            (Some(k), Some((_, stored))) => stored[..len]
                .iter()
                .map(|p| PositionLogprob {
                    logprob: p.logprob,
                    rank: p.rank,
                    top: p.top.iter().take(k).copied().collect(),
                })
                .collect(),
            _ => Vec::new(),
        };
        Ok(Some(Hit {
            cache: entry.cache.prefix(len)?,
            len,
            logprobs,
        }))
    }

    /// Stores a prefilled prompt (`cache` holds exactly its positions), with its tokens'
    /// logprobs when they were computed, evicting the least recently used entries beyond the
    /// capacity. An entry that the new one extends is replaced by it.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        cache: &KvCache,
        logprobs: Option<(usize, &[PositionLogprob])>,
        scope: &Scope,
    ) -> candle_core::Result<()> {
        let bytes = tokens.len() * self.bytes_per_token;
        if tokens.len() < 2 || bytes > self.capacity_bytes || cache.len() != tokens.len() {
            return Ok(());
        }
        let new_k = logprobs.map(|(k, _)| k);
        // Entries this one covers: a prefix of its tokens, with no better logprobs.
        let covered = |e: &Entry| {
            &e.scope == scope
                && e.tokens.len() <= tokens.len()
                && tokens.starts_with(&e.tokens)
                && e.logprobs.as_ref().map(|(k, _)| *k) <= new_k
        };
        let before = self.entries.len();
        self.entries.retain(|e| !covered(e));
        if self.entries.len() != before {
            self.recount();
        }
        if (self.entries.iter()).any(|e| &e.scope == scope && e.tokens.starts_with(tokens)) && new_k.is_none() {
            return Ok(()); // a longer entry already holds all of it
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            // Exactly the prompt's positions: entries are copied from, never grown.
            cache: cache.compact()?,
            logprobs: logprobs.map(|(k, l)| (k, l.to_vec())),
            scope: scope.clone(),
            last_used: self.clock,
        });
        self.used_bytes += bytes;
        while self.used_bytes > self.capacity_bytes {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
            self.recount();
        }
        Ok(())
    }

    fn recount(&mut self) {
        self.used_bytes = self.entries.iter().map(|e| e.tokens.len() * self.bytes_per_token).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salted(salt: &str) -> Scope {
        Scope {
            adapter: None,
            salt: Some(salt.into()),
        }
    }

    /// A cache of `len` positions from a tiny model with zero weights.
    fn cache(len: usize) -> KvCache {
        let cfg = gpt::Config::tiny(50);
        let vb = candle_nn::VarBuilder::zeros(candle_core::DType::F32, &candle_core::Device::Cpu);
        let model = gpt::Gpt::new(vb, &cfg).expect("model");
        let mut cache = model.new_cache();
        let tokens: Vec<u32> = (0..len as u32).collect();
        model
            .forward_step(
                &mut [gpt::SeqStep {
                    tokens: &tokens,
                    cache: &mut cache,
                }],
                gpt::LogitsFor::Last,
            )
            .expect("step");
        cache
    }

    fn logprobs(n: usize, k: usize) -> Vec<PositionLogprob> {
        (0..n)
            .map(|t| PositionLogprob {
                logprob: -(t as f32),
                rank: Some(t as u32 + 1),
                top: (0..k as u32).map(|i| (i, -1.0)).collect(),
            })
            .collect()
    }

    #[test]
    fn the_longest_shared_prefix_is_reused_and_one_token_is_left_to_prefill() {
        let mut store = PrefixStore::new(1 << 20, 10);
        store
            .insert(&[1, 2, 3, 4], &cache(4), None, &Scope::default())
            .expect("insert");
        store
            .insert(&[1, 2, 9, 9, 9], &cache(5), None, &Scope::default())
            .expect("insert");
        let hit = store
            .lookup(&[1, 2, 3, 7], None, &Scope::default())
            .expect("lookup")
            .expect("a hit");
        assert_eq!((hit.len, hit.cache.len()), (3, 3));
        // The whole stored prompt again: all but its last token.
        assert_eq!(
            store
                .lookup(&[1, 2, 3, 4], None, &Scope::default())
                .expect("lookup")
                .map(|h| h.len),
            Some(3)
        );
        assert!(store
            .lookup(&[5, 1, 2], None, &Scope::default())
            .expect("lookup")
            .is_none());
    }

    #[test]
    fn prompt_logprobs_come_from_entries_that_stored_enough_of_them() {
        let mut store = PrefixStore::new(1 << 20, 10);
        store
            .insert(&[1, 2, 3, 4], &cache(4), None, &Scope::default())
            .expect("insert");
        // No stored logprobs: no reuse for a request that wants them.
        assert!(store
            .lookup(&[1, 2, 3, 5], Some(1), &Scope::default())
            .expect("lookup")
            .is_none());
        store
            .insert(&[1, 2, 3, 4], &cache(4), Some((2, &logprobs(3, 2))), &Scope::default())
            .expect("insert");
        // One position less than the common prefix; tokens 1..=2's logprobs, top cut to k.
        let hit = store
            .lookup(&[1, 2, 3, 5], Some(1), &Scope::default())
            .expect("lookup")
            .expect("a hit");
        assert_eq!(hit.len, 2);
        assert_eq!(hit.logprobs.len(), 2);
        assert!(hit.logprobs.iter().all(|p| p.top.len() == 1));
        assert!(store
            .lookup(&[1, 2, 3, 5], Some(3), &Scope::default())
            .expect("lookup")
            .is_none());
    }

    #[test]
    fn the_store_stays_within_its_capacity_evicting_the_least_recently_used() {
        let mut store = PrefixStore::new(100, 10); // 10 positions
        store
            .insert(&[1, 1, 1, 1], &cache(4), None, &Scope::default())
            .expect("insert");
        store
            .insert(&[2, 2, 2, 2], &cache(4), None, &Scope::default())
            .expect("insert");
        assert!(store
            .lookup(&[1, 1, 1, 1, 5], None, &Scope::default())
            .expect("lookup")
            .is_some()); // 1s used last
        store
            .insert(&[3, 3, 3, 3], &cache(4), None, &Scope::default())
            .expect("insert");
        assert!(store.used_bytes() <= 100);
        assert!(store
            .lookup(&[2, 2, 2, 2, 5], None, &Scope::default())
            .expect("lookup")
            .is_none());
        assert!(store
            .lookup(&[1, 1, 1, 1, 5], None, &Scope::default())
            .expect("lookup")
            .is_some());
        // Larger than the whole store: not kept.
        store
            .insert(&[4; 11], &cache(11), None, &Scope::default())
            .expect("insert");
        assert!(store
            .lookup(&[4; 12], None, &Scope::default())
            .expect("lookup")
            .is_none());
        // Off.
        let mut off = PrefixStore::new(0, 10);
        off.insert(&[1, 1, 1, 1], &cache(4), None, &Scope::default())
            .expect("insert");
        assert!(off
            .lookup(&[1, 1, 1, 1, 5], None, &Scope::default())
            .expect("lookup")
            .is_none());
    }

    fn for_adapter(id: u64) -> Scope {
        Scope {
            adapter: Some(id),
            salt: None,
        }
    }

    #[test]
    fn salted_or_adapted_prompts_share_entries_only_within_their_scope() {
        for (mine, other) in [(salted("a"), salted("b")), (for_adapter(1), for_adapter(2))] {
            let mut store = PrefixStore::new(1 << 20, 1);
            store.insert(&[1, 2, 3, 4], &cache(4), None, &mine).expect("insert");
            for (scope, hit) in [(Scope::default(), None), (other.clone(), None), (mine.clone(), Some(3))] {
                let found = store.lookup(&[1, 2, 3, 5], None, &scope).expect("lookup");
                assert_eq!(found.map(|h| h.len), hit, "{mine:?} looked up as {scope:?}");
            }
            // The same tokens unscoped are an entry of their own, not a cover of the scoped one.
            store
                .insert(&[1, 2, 3, 4, 5], &cache(5), None, &Scope::default())
                .expect("insert");
            let found = store.lookup(&[1, 2, 3, 4, 6], None, &mine).expect("lookup");
            assert_eq!(found.map(|h| h.len), Some(4));
            let found = store
                .lookup(&[1, 2, 3, 4, 5, 6], None, &Scope::default())
                .expect("lookup");
            assert_eq!(found.map(|h| h.len), Some(5));
        }
    }
}
