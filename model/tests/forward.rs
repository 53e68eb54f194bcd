//! The forward pass: causality, KV-cache parity (one and several sequences), limits, dtypes.

mod common;

use candle_core::{DType, IndexOp, Tensor};
use common::{batch, max_abs_diff, random_model, tokens};
use gpt::{Config, Dropout, Error, LogitsFor, PositionEmbedding, SeqStep};

fn cfg() -> Config {
    Config::tiny(97)
}

#[test]
fn changing_later_tokens_leaves_earlier_logits_unchanged() -> anyhow::Result<()> {
    for pe in [PositionEmbedding::Learned, PositionEmbedding::Sinusoidal] {
        let cfg = Config {
            position_embedding: pe,
            ..cfg()
        };
        let (_vm, model) = random_model(&cfg)?;
        let a = tokens(24, cfg.vocab_size, 1);
        let mut b = a.clone();
        let t = 10;
        for (i, id) in b.iter_mut().enumerate().skip(t + 1) {
            *id = (*id + 1 + i as u32) % cfg.vocab_size as u32;
        }
        let la = model.forward(&batch(&[a])?, None)?;
        let lb = model.forward(&batch(&[b])?, None)?;
        let prefix = max_abs_diff(&la.i((.., ..=t, ..))?, &lb.i((.., ..=t, ..))?)?;
        assert_eq!(prefix, 0.0, "{pe:?}: logits at positions <= {t} changed");
        // The check has teeth: later positions do change.
        let suffix = max_abs_diff(&la.i((.., t + 1.., ..))?, &lb.i((.., t + 1.., ..))?)?;
        assert!(suffix > 1e-3, "{pe:?}: later logits did not change ({suffix})");
    }
    Ok(())
}

/// The logits `(T, V)` of `ids` from a prefill of its first `prompt` tokens and then one token
/// per step, and the cache that holds them.
fn prefill_then_decode(model: &gpt::Gpt, ids: &[u32], prompt: usize) -> anyhow::Result<(Tensor, gpt::KvCache)> {
    let mut cache = model.new_cache();
    let mut steps = vec![model.forward_step(
        &mut [SeqStep {
            tokens: &ids[..prompt],
            cache: &mut cache,
        }],
        LogitsFor::All,
    )?];
    for id in &ids[prompt..] {
        let step = SeqStep {
            tokens: std::slice::from_ref(id),
            cache: &mut cache,
        };
        steps.push(model.forward_step(&mut [step], LogitsFor::Last)?);
    }
    Ok((Tensor::cat(&steps, 0)?, cache))
}

#[test]
fn prefill_then_decode_matches_full_forward() -> anyhow::Result<()> {
    // Decoding one token at a time past the cache's first 64-position buffer (it grows).
    let cfg = Config {
        n_positions: 128,
        ..cfg()
    };
    let (_vm, model) = random_model(&cfg)?;
    let ids = tokens(90, cfg.vocab_size, 7);
    let full = model.forward(&batch(std::slice::from_ref(&ids))?, None)?.squeeze(0)?; // (T, V)

    let (incremental, cache) = prefill_then_decode(&model, &ids, 17)?;
    assert_eq!(cache.len(), ids.len());
    let diff = max_abs_diff(&full, &incremental)?;
    assert!(diff < 1e-4, "cache vs full forward: max abs diff {diff}");
    Ok(())
}

/// A sliding-window layer's cache gives its oldest blocks back as the sequence moves on:
/// decoding to 200 positions under a window of 10 (every layer local, as Mistral's; a local
/// layer beside a global one, as Gemma 3's) gives the full forward's logits, and a truncation or
/// a prefix that needs a position no longer held is an error that changes nothing.
#[test]
fn a_sliding_window_decodes_past_the_blocks_it_gave_back() -> anyhow::Result<()> {
    use gpt::arch::Family;
    for (family, local) in [(Family::Mistral, vec![]), (Family::Gemma3, vec![true, false])] {
        let shape = Config {
            n_positions: 256,
            ..cfg()
        };
        let mut cfg = gpt::arch::from_scratch(family, &shape, Some(2))?;
        cfg.variant.sliding_window = Some(10);
        cfg.variant.sliding_layers = local;
        let (_vm, model) = random_model(&cfg)?;
        let ids = tokens(200, cfg.vocab_size, 11);
        let full = model.forward(&batch(std::slice::from_ref(&ids))?, None)?.squeeze(0)?; // (T, V)
        let (incremental, mut cache) = prefill_then_decode(&model, &ids, 30)?;
        let diff = max_abs_diff(&full, &incremental)?;
        assert!(diff < 1e-4, "{family:?}: cache vs full forward: max abs diff {diff}");
        // Back to where the last step began, and on again: the same last logits.
        cache.truncate(199)?;
        let again = model.forward_step(
            &mut [SeqStep {
                tokens: &ids[199..],
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )?;
        assert!(max_abs_diff(&again, &full.i(199..)?)? < 1e-4, "{family:?}");
        // A query at 60 sees from 51, in the first block of 64, which went back (with a block
        // of slack) once the cache held 137 positions.
        assert!(cache.truncate(60).is_err() && cache.prefix(60).is_err(), "{family:?}");
        assert_eq!(cache.prefix(140)?.len(), 140, "{family:?}: a block's worth back");
        // The boundary: a query at 73 sees from 64, the first position held.
        assert_eq!(cache.shortest_prefix(), 73, "{family:?}");
        assert!(cache.prefix(73).is_ok() && cache.prefix(72).is_err(), "{family:?}");
        assert_eq!(cache.len(), 200, "{family:?}: a refused truncation changes nothing");
        assert_eq!(cache.prefix(195)?.len(), 195, "{family:?}");
    }
    Ok(())
}

#[test]
fn forked_caches_continue_independently_and_truncate_undoes_steps() -> anyhow::Result<()> {
    let cfg = Config {
        n_positions: 256,
        ..cfg()
    };
    let (_vm, model) = random_model(&cfg)?;
    let (prompt, a, b) = (
        tokens(70, cfg.vocab_size, 3),
        tokens(5, cfg.vocab_size, 4),
        tokens(5, cfg.vocab_size, 5),
    );
    let step = |cache: &mut gpt::KvCache, ids: &[u32]| -> anyhow::Result<Tensor> {
        Ok(model.forward_step(&mut [SeqStep { tokens: ids, cache }], LogitsFor::All)?)
    };
    let mut first = model.new_cache();
    step(&mut first, &prompt)?; // 70 positions: more than one allocation chunk
    let mut second = first.fork()?;
    assert_eq!(second.len(), prompt.len());
    // Each continues with its own tokens; neither overwrites the other's positions.
    let la = step(&mut first, &a)?;
    let lb = step(&mut second, &b)?;
    for (ids, logits) in [(&a, &la), (&b, &lb)] {
        let whole: Vec<u32> = prompt.iter().chain(ids.iter()).copied().collect();
        let full = model.forward(&batch(&[whole])?, None)?.squeeze(0)?;
        let diff = max_abs_diff(logits, &full.narrow(0, prompt.len(), ids.len())?)?;
        assert!(diff < 1e-4, "fork: diff {diff}");
    }
    // Rolling `first` back to the prompt and replaying `b` gives `second`'s logits.
    first.truncate(prompt.len())?;
    assert_eq!(first.len(), prompt.len());
    let again = step(&mut first, &b)?;
    assert!(max_abs_diff(&again, &lb)? < 1e-5);
    // A compact copy (exactly its positions, as the prefix store keeps) gives the same again,
    // grown through a prefix of it past its own size.
    let mut kept = first.prefix(prompt.len())?.compact()?;
    assert_eq!(kept.len(), prompt.len());
    let mut grown = kept.prefix(prompt.len())?;
    assert_eq!(step(&mut grown, &b)?.to_vec2::<f32>()?, again.to_vec2::<f32>()?);
    assert_eq!(step(&mut kept, &b)?.to_vec2::<f32>()?, again.to_vec2::<f32>()?);
    Ok(())
}

#[test]
fn reserved_caches_decode_as_growing_ones() -> anyhow::Result<()> {
    let cfg = Config {
        n_positions: 256,
        ..cfg()
    };
    let (_vm, model) = random_model(&cfg)?;
    let ids = tokens(150, cfg.vocab_size, 9);
    let prompt = 20;
    // Grown chunk by chunk; reserved before the first step; reserved after it (buffers already
    // there grow and keep what they hold); forked from a reserved one half-way.
    let mut caches = [model.new_cache(), model.new_cache(), model.new_cache()];
    caches[1].reserve(ids.len())?;
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 4];
    let mut fork = None;
    for (i, cache) in caches.iter_mut().enumerate() {
        let step = |cache: &mut gpt::KvCache, t: &[u32]| -> anyhow::Result<Vec<f32>> {
            let out = model.forward_step(&mut [SeqStep { tokens: t, cache }], LogitsFor::Last)?;
            Ok(out.flatten_all()?.to_vec1::<f32>()?)
        };
        logits[i].push(step(cache, &ids[..prompt])?);
        if i == 2 {
            cache.reserve(ids.len())?;
        }
        for (p, id) in ids.iter().enumerate().skip(prompt) {
            logits[i].push(step(cache, std::slice::from_ref(id))?);
            if i == 1 && p == 100 {
                fork = Some(cache.fork()?);
            }
        }
    }
    let mut fork = fork.expect("forked at position 100");
    for id in &ids[101..] {
        let out = model.forward_step(
            &mut [SeqStep {
                tokens: std::slice::from_ref(id),
                cache: &mut fork,
            }],
            LogitsFor::Last,
        )?;
        logits[3].push(out.flatten_all()?.to_vec1::<f32>()?);
    }
    assert_eq!(logits[0].len(), ids.len() - prompt + 1);
    assert_eq!(logits[1], logits[0], "reserved at the start");
    assert_eq!(logits[2], logits[0], "reserved after the prompt");
    assert_eq!(logits[3], logits[0][logits[0].len() - logits[3].len()..], "forked");
    Ok(())
}

#[test]
fn rows_are_chosen_per_sequence() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let seqs = [tokens(6, cfg.vocab_size, 8), tokens(9, cfg.vocab_size, 9)];
    let mut caches = [model.new_cache(), model.new_cache()];
    let mut steps: Vec<SeqStep> = seqs
        .iter()
        .zip(caches.iter_mut())
        .map(|(s, cache)| SeqStep { tokens: s, cache })
        .collect();
    let hidden = model.forward_step_hidden(&mut steps, &[LogitsFor::Last, LogitsFor::All])?;
    let logits = model.logits(&hidden)?; // (1 + 9, V)
    assert_eq!(logits.dims(), [10, cfg.vocab_size]);
    let full0 = model.forward(&batch(&[seqs[0].clone()])?, None)?.squeeze(0)?;
    let full1 = model.forward(&batch(&[seqs[1].clone()])?, None)?.squeeze(0)?;
    assert!(max_abs_diff(&logits.i(0)?, &full0.i(5)?)? < 1e-4);
    assert!(max_abs_diff(&logits.narrow(0, 1, 9)?, &full1)? < 1e-4);
    Ok(())
}

#[test]
fn sequences_of_different_lengths_step_together() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let seqs: Vec<Vec<u32>> = [(5, 11), (23, 12), (1, 13), (31, 14)]
        .iter()
        .map(|&(n, seed)| tokens(n + 6, cfg.vocab_size, seed))
        .collect();
    let prompt_lens = [5, 23, 1, 31];
    let mut caches: Vec<_> = seqs.iter().map(|_| model.new_cache()).collect();

    // Prefill all four prompts in one step, then decode six tokens for all of them together.
    let mut step: Vec<SeqStep> = seqs
        .iter()
        .zip(&prompt_lens)
        .zip(caches.iter_mut())
        .map(|((s, &n), cache)| SeqStep { tokens: &s[..n], cache })
        .collect();
    let mut last = vec![model.forward_step(&mut step, LogitsFor::Last)?]; // (4, V)
    for k in 0..6 {
        let mut step: Vec<SeqStep> = seqs
            .iter()
            .zip(&prompt_lens)
            .zip(caches.iter_mut())
            .map(|((s, &n), cache)| SeqStep {
                tokens: &s[n + k..n + k + 1],
                cache,
            })
            .collect();
        last.push(model.forward_step(&mut step, LogitsFor::Last)?);
    }

    for (s, seq) in seqs.iter().enumerate() {
        let full = model.forward(&batch(std::slice::from_ref(seq))?, None)?.squeeze(0)?; // (T, V)
        for (k, logits) in last.iter().enumerate() {
            let pos = prompt_lens[s] - 1 + k;
            let diff = max_abs_diff(&logits.i(s)?, &full.i(pos)?)?;
            assert!(diff < 1e-4, "sequence {s}, position {pos}: diff {diff}");
        }
        assert_eq!(caches[s].len(), seq.len());
    }
    Ok(())
}

#[test]
fn batched_windows_equal_one_at_a_time() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let rows: Vec<Vec<u32>> = (0..3).map(|s| tokens(16, cfg.vocab_size, 100 + s)).collect();
    let together = model.forward(&batch(&rows)?, None)?;
    for (i, row) in rows.iter().enumerate() {
        let alone = model.forward(&batch(std::slice::from_ref(row))?, None)?;
        assert!(max_abs_diff(&together.i(i)?, &alone.squeeze(0)?)? < 1e-5);
    }
    Ok(())
}

#[test]
fn training_path_equals_inference_path_without_dropout() -> anyhow::Result<()> {
    let cfg = cfg(); // tiny() has zero dropout
    let (_vm, model) = random_model(&cfg)?;
    let idx = batch(&[tokens(20, cfg.vocab_size, 3)])?;
    let train = Some(Dropout { key: 1, first_row: 0 });
    let diff = max_abs_diff(&model.forward(&idx, train)?, &model.forward(&idx, None)?)?;
    assert!(diff < 1e-4, "fused vs differentiable ops: {diff}");
    Ok(())
}

#[test]
fn dropout_masks_follow_their_key_and_rows_not_the_batch_split() -> anyhow::Result<()> {
    let cfg = Config {
        resid_pdrop: 0.2,
        embd_pdrop: 0.2,
        attn_pdrop: 0.2,
        ..cfg()
    };
    let (_vm, model) = random_model(&cfg)?;
    let rows = [tokens(16, cfg.vocab_size, 4), tokens(16, cfg.vocab_size, 5)];
    let both = batch(&rows)?;
    let key = |key, first_row| Some(Dropout { key, first_row });
    let a = model.forward(&both, key(7, 0))?;
    assert_eq!(
        max_abs_diff(&a, &model.forward(&both, key(7, 0))?)?,
        0.0,
        "same key, same masks"
    );
    assert!(
        max_abs_diff(&a, &model.forward(&both, key(8, 0))?)? > 1e-3,
        "another key, other masks"
    );
    assert!(max_abs_diff(&a, &model.forward(&both, None)?)? > 1e-3, "dropout is on");
    // The second row alone, as the second shard of the batch, draws the masks it had in the batch.
    let second = model.forward(&batch(&rows[1..])?, key(7, 1))?;
    assert!(max_abs_diff(&second.squeeze(0)?, &a.i(1)?)? < 1e-5);
    Ok(())
}

#[test]
fn going_past_the_context_is_an_error_and_leaves_the_cache_alone() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let too_long = batch(&[tokens(cfg.n_positions + 1, cfg.vocab_size, 1)])?;
    assert!(matches!(
        model.forward(&too_long, None),
        Err(Error::ContextOverflow { needed: 65, max: 64 })
    ));

    let mut cache = model.new_cache();
    let ids = tokens(cfg.n_positions, cfg.vocab_size, 2);
    model.forward_step(
        &mut [SeqStep {
            tokens: &ids,
            cache: &mut cache,
        }],
        LogitsFor::Last,
    )?;
    let err = model
        .forward_step(
            &mut [SeqStep {
                tokens: &[1],
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )
        .unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { needed: 65, max: 64 }), "{err}");
    assert!(err.to_string().contains("64"), "{err}");
    assert_eq!(cache.len(), cfg.n_positions);
    Ok(())
}

#[test]
fn bad_step_inputs_are_errors_not_panics() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let mut cache = model.new_cache();
    let err = model
        .forward_step(
            &mut [SeqStep {
                tokens: &[3, 97],
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::TokenOutOfVocab { id: 97, vocab_size: 97 }),
        "{err}"
    );
    assert!(matches!(
        model.forward_step(
            &mut [SeqStep {
                tokens: &[],
                cache: &mut cache
            }],
            LogitsFor::Last
        ),
        Err(Error::EmptyInput(_))
    ));
    assert!(matches!(
        model.forward_step(&mut [], LogitsFor::Last),
        Err(Error::EmptyInput(_))
    ));
    assert!(cache.is_empty());
    Ok(())
}

#[test]
fn half_precision_inference_stays_close_to_f32() -> anyhow::Result<()> {
    let cfg = cfg();
    let (_vm, model) = random_model(&cfg)?;
    let dir = tempfile::tempdir()?;
    let tok = gpt::Tokenizer::train_char(&[write_corpus(dir.path())?])?;
    gpt::save_dir(dir.path(), &model, &tok, DType::F32)?;
    let ids = tokens(30, cfg.vocab_size, 5);
    let reference = model.forward(&batch(std::slice::from_ref(&ids))?, None)?.squeeze(0)?;
    // The error relative to the logits' scale, as the weights are random (each run draws new
    // ones): the largest and the root-mean-square difference. Over 40 random models on each of
    // the AVX-512, AVX2 and portable kernels the worst were 0.8% and 0.3% for f16 and 5.8% and
    // 2.1% for bf16 (8 significand bits, and a bf16 model keeps its activations in bf16); the
    // bounds are about twice those, far below what a wrong product or layer gives.
    let relative = |logits: &Tensor| -> anyhow::Result<(f32, f32)> {
        let diff = (logits.to_dtype(DType::F32)? - &reference)?;
        let max = diff.abs()?.max_all()?.to_scalar::<f32>()? / reference.abs()?.max_all()?.to_scalar::<f32>()?;
        let rms = |t: &Tensor| -> candle_core::Result<f32> { t.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>() };
        Ok((max, rms(&diff)? / rms(&reference)?))
    };
    for (dtype, max_tol, rms_tol) in [(DType::F16, 0.02, 0.008), (DType::BF16, 0.12, 0.05)] {
        let half = gpt::load_model(dir.path(), dtype, &candle_core::Device::Cpu)?;
        assert_eq!(half.dtype(), dtype);
        let (max, rms) = relative(&half.forward(&batch(std::slice::from_ref(&ids))?, None)?.squeeze(0)?)?;
        assert!(
            max < max_tol && rms < rms_tol,
            "{dtype:?}: relative difference max {max}, rms {rms}"
        );
        // The cached path runs in half precision too: prefill, then one token at a time.
        let mut cache = half.new_cache();
        let mut rows = vec![half.forward_step(
            &mut [SeqStep {
                tokens: &ids[..20],
                cache: &mut cache,
            }],
            LogitsFor::All,
        )?];
        for id in &ids[20..] {
            rows.push(half.forward_step(
                &mut [SeqStep {
                    tokens: std::slice::from_ref(id),
                    cache: &mut cache,
                }],
                LogitsFor::All,
            )?);
        }
        let (max, rms) = relative(&Tensor::cat(&rows, 0)?)?;
        assert!(
            max < max_tol && rms < rms_tol,
            "{dtype:?} cached: relative difference max {max}, rms {rms}"
        );
    }
    Ok(())
}

fn write_corpus(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, "abcdefghij klmnopqrstuvwxyz\n")?;
    Ok(path)
}
