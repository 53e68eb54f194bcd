//! The CUDA path against the CPU path (`cargo test --release --features cuda -p gpt-e2e --test
//! cuda`, on a machine with an NVIDIA GPU; `bench/gpu.sh` builds and runs it). Each check runs the
//! same computation on both devices and compares: the fused kernels forward and backward (the
//! training attention among them), a training step's loss and gradients and its clipped AdamW
//! update, the fixture's logits (whole and through the KV cache), greedy generation, and
//! `gpt-train eval`'s perplexity.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::VarMap;
use gpt::{LogitsFor, SeqStep};

/// `rel` under the working directory when it is there (the GPU machine runs this binary from a
/// copy of the repository), else under this source tree.
fn repo(rel: &str) -> PathBuf {
    let local = PathBuf::from(rel);
    if local.exists() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA GPU")
}

use gpt_test_support as support;

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    support::max_abs_diff(a, b).expect("tensors of one shape")
}

/// `f` on the CPU and on the GPU with the same inputs: its outputs, and the gradients of
/// `sum(output * g)` with respect to each input.
fn both_ways(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>) -> [(Tensor, Vec<Tensor>); 2] {
    [Device::Cpu, gpu()].map(|dev| {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(&dev).unwrap()).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let g = Tensor::ones(y.shape(), DType::F32, &Device::Cpu)
            .unwrap()
            .cumsum(D::Minus1)
            .unwrap()
            .sin()
            .unwrap()
            .to_device(&dev)
            .unwrap();
        let grads = (&y * g).unwrap().sum_all().unwrap().backward().unwrap();
        let gs = vars
            .iter()
            .map(|v| grads.get(v).unwrap().to_device(&Device::Cpu).unwrap())
            .collect();
        (y.to_device(&Device::Cpu).unwrap(), gs)
    })
}

fn max_abs(a: &Tensor) -> f32 {
    a.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Forward within 1e-5 and gradients within 1e-4 of the CPU, relative to the largest magnitude
/// (1 at least): a sum over thousands of rows is added in another order on the GPU.
fn assert_same_both_ways(name: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>) {
    let [(y_cpu, g_cpu), (y_gpu, g_gpu)] = both_ways(inputs, f);
    let d = max_diff(&y_cpu, &y_gpu);
    assert!(d < 1e-5 * max_abs(&y_cpu).max(1.0), "{name}: forward differs by {d}");
    for (i, (a, b)) in g_cpu.iter().zip(&g_gpu).enumerate() {
        let d = max_diff(a, b);
        assert!(
            d < 1e-4 * max_abs(a).max(1.0),
            "{name}: gradient {i} differs by {d} (largest {})",
            max_abs(a)
        );
    }
}

fn randn(shape: &[usize], std: f32) -> Tensor {
    Tensor::randn(0f32, std, shape, &Device::Cpu).unwrap()
}

#[test]
fn fused_kernels_match_the_cpu_forward_and_backward() {
    assert!(gpt_kernels::cuda_fused(), "GPT_CUDA_FUSED=0 is set: nothing to compare");
    for shape in [vec![7, 33], vec![4, 256, 1536]] {
        assert_same_both_ways("gelu", &[randn(&shape, 2.0)], |t| gpt_kernels::gelu(&t[0]));
    }
    for (x, b) in [(vec![3, 5, 8], vec![5, 8]), (vec![16, 256, 384], vec![384])] {
        assert_same_both_ways("add_tiled", &[randn(&x, 1.0), randn(&b, 1.0)], |t| {
            gpt_kernels::add_tiled(&t[0], &t[1])
        });
    }
    for c in [8, 384, 770] {
        let inputs = [
            randn(&[3, 67, c], 2.0),
            (randn(&[c], 0.5) + 1.0).unwrap(),
            randn(&[c], 0.5),
        ];
        assert_same_both_ways("layer_norm", &inputs, |t| {
            gpt_kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5)
        });
    }
    for (t_q, t_k) in [(5, 5), (3, 8), (1, 4), (256, 256), (1, 300), (40, 1100)] {
        assert_same_both_ways("causal_softmax", &[randn(&[2, 3, t_q, t_k], 3.0)], |t| {
            gpt_kernels::causal_softmax(&t[0], true)
        });
    }
    // Dropout draws the same masks on both devices (counter-based, keyed), also from a later row.
    for (shape, first_row) in [(vec![7, 33], 0), (vec![16, 256, 384], 5)] {
        assert_same_both_ways("dropout", &[randn(&shape, 1.0)], |t| {
            gpt_kernels::dropout(&t[0], 0.2, 0xDEAD_BEEF, first_row)
        });
    }
}

/// The attention op of training and evaluation (ops.cu's window_attention kernels): odd window
/// lengths, head sizes up to the kernels' 128, dropout of the attention weights from a later
/// window of the batch (masks counted in the whole batch's weights, as the CPU counts them).
#[test]
fn fused_kernels_window_attention_matches_the_cpu_forward_and_backward() {
    assert!(gpt_kernels::cuda_fused(), "GPT_CUDA_FUSED=0 is set: nothing to compare");
    let simd = gpt_kernels::Simd::detect();
    for (b, t, nh, hs, p, first_row) in [
        (2, 45, 3, 32, 0.0, 0),
        (3, 70, 2, 64, 0.2, 1),
        (1, 9, 2, 20, 0.2, 2),
        (2, 33, 1, 128, 0.0, 0),
        (1, 256, 6, 64, 0.1, 0),
    ] {
        let qkv = randn(&[b * t, 3 * nh * hs], 1.0);
        let scale = 1.0 / (hs as f32).sqrt();
        assert_same_both_ways(
            &format!("window_attention {b}x{t}, {nh} heads of {hs}, p {p}"),
            &[qkv],
            |x| gpt_kernels::window_attention(simd, &x[0], t, nh, scale, p, 0xC0FFEE, first_row, None),
        );
    }
}

/// A seeded model, identical on both devices (weights drawn on the host), with its variables
/// sorted by name.
fn seeded_model(cfg: &gpt::Config, device: &Device) -> (gpt::Gpt, Vec<(String, Var)>) {
    let varmap = VarMap::new();
    let vb = gpt_train::init::seeded_var_builder(&varmap, 1337, device);
    let model = gpt::Gpt::new(vb, cfg).unwrap();
    (model, gpt_train::init::named_vars(&varmap).unwrap())
}

#[test]
fn a_training_step_matches_the_cpu() {
    let cfg = gpt::Config {
        n_positions: 64,
        n_embd: 96,
        n_layer: 2,
        n_head: 4,
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        ..gpt::Config::tiny(80)
    };
    let tokens: Vec<u32> = (0..4 * 65).map(|i| ((i * 37 + i / 7) % 80) as u32).collect();
    let mut results = Vec::new();
    let mut max_norm = None;
    for dev in [Device::Cpu, gpu()] {
        let (model, named) = seeded_model(&cfg, &dev);
        let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let data = Tensor::from_vec(tokens.clone(), (4, 65), &dev).unwrap();
        let (x, y) = (data.narrow(1, 0, 64).unwrap(), data.narrow(1, 1, 64).unwrap());
        let (loss, grads) =
            gpt_train::step::accumulate_grads(&model, &vars, &[(x, y).into()], 1, Default::default()).unwrap();
        let norm = gpt_train::optim::global_norm(&grads).unwrap();
        // Half the CPU's norm: the update clips, on the GPU inside its kernels.
        let max_norm = *max_norm.get_or_insert(norm / 2.0);
        // eps well above the gradients' rounding differences: at the first step AdamW moves each
        // weight by lr * g / (|g| + eps), which for eps -> 0 is lr * sign(g), and a gradient of
        // about 0 could take either sign on the two devices.
        let adam = gpt_train::optim::AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-3,
            weight_decay: 0.1,
        };
        let mut opt = gpt_train::optim::AdamW::new(named.clone(), adam).unwrap();
        opt.step_clipped(&grads, 1e-3, max_norm).unwrap();
        let grads: Vec<Tensor> = grads.iter().map(|g| g.to_device(&Device::Cpu).unwrap()).collect();
        let weights: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().to_device(&Device::Cpu).unwrap())
            .collect();
        results.push((loss, norm, grads, weights));
    }
    let (cpu, gpu) = (&results[0], &results[1]);
    assert!((cpu.0 - gpu.0).abs() < 1e-4, "loss: cpu {} cuda {}", cpu.0, gpu.0);
    assert!(
        (cpu.1 - gpu.1).abs() < 1e-3 * cpu.1,
        "grad norm: cpu {} cuda {}",
        cpu.1,
        gpu.1
    );
    for (i, (a, b)) in cpu.2.iter().zip(&gpu.2).enumerate() {
        let d = max_diff(a, b);
        assert!(d < 1e-4, "gradient {i} differs by {d}");
    }
    for (i, (a, b)) in cpu.3.iter().zip(&gpu.3).enumerate() {
        let d = max_diff(a, b);
        assert!(d < 1e-5, "weight {i} after AdamW differs by {d}");
    }
}

/// With `GPT_CUDA_TAPE=1`, training's backward pass on the GPU runs on the tape (the residual
/// stream as rows, every op the tape's, the LM head and loss as one candle entry): with dropout
/// at every site, its gradients are those of candle's backward over the same pass on the GPU, for
/// every variable. (`bench/gpu.sh session` runs these tests with it set, and without.)
#[test]
fn the_tape_on_the_gpu_gives_candles_gradients() {
    if !gpt_kernels::cuda_tape() {
        eprintln!("GPT_CUDA_TAPE is not 1: the GPU's tape is not checked in this run");
        return;
    }
    let cfg = gpt::Config {
        n_positions: 64,
        n_embd: 96,
        n_layer: 2,
        n_head: 4,
        resid_pdrop: 0.1,
        embd_pdrop: 0.1,
        attn_pdrop: 0.1,
        ..gpt::Config::tiny(80)
    };
    let dev = gpu();
    let (model, named) = seeded_model(&cfg, &dev);
    assert!(model.trains_on_tape(), "f32 on the GPU trains on the tape");
    let leaves: Vec<&Tensor> = named.iter().map(|(_, v)| v.as_tensor()).collect();
    let tokens: Vec<u32> = (0..4 * 65).map(|i| ((i * 29 + i / 5) % 80) as u32).collect();
    let data = Tensor::from_vec(tokens, (4, 65), &dev).unwrap();
    let (x, y) = (data.narrow(1, 0, 64).unwrap(), data.narrow(1, 1, 64).unwrap());
    let train = Some(gpt::Dropout { key: 5, first_row: 2 });
    let mut candle = model.loss(&x, &y, train, 0.1).unwrap().backward().unwrap();
    let (loss, tape) = gpt_kernels::tape::record(|| model.loss(&x, &y, train, 0.1)).unwrap();
    let on_tape = tape.backward(&loss, 1.0, &leaves).unwrap();
    for ((name, var), got) in named.iter().zip(on_tape) {
        let got = got.unwrap_or_else(|| panic!("{name}: no gradient on the tape"));
        let want = candle
            .remove(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient from candle"));
        let scale = max_abs(&want);
        let d = max_diff(&got, &want);
        assert!(scale > 0.0 && d <= 1e-5 * scale, "{name}: differs by {d} of {scale}");
    }
}

/// Logits of the fixture model for `ids`, whole and then through the KV cache one token at a
/// time, on `dev`.
fn fixture_logits(ids: &[u32], dev: &Device) -> (Tensor, Tensor) {
    let (model, _) = gpt::load_dir(&repo("tests/fixtures/tiny-gpt2"), DType::F32, dev).unwrap();
    let whole = model
        .forward(&Tensor::new(ids, dev).unwrap().unsqueeze(0).unwrap(), None)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let mut cache = model.new_cache();
    let steps: Vec<Tensor> = ids
        .iter()
        .map(|id| {
            let step = SeqStep {
                tokens: std::slice::from_ref(id),
                cache: &mut cache,
            };
            model.forward_step(&mut [step], LogitsFor::Last).unwrap()
        })
        .collect();
    (whole, Tensor::cat(&steps, 0).unwrap())
}

#[test]
fn fixture_logits_match_the_cpu_within_1e_3() {
    let (_, tok) = gpt::load_dir(&repo("tests/fixtures/tiny-gpt2"), DType::F32, &Device::Cpu).unwrap();
    let ids = tok
        .encode("The quick brown fox jumps over the lazy dog. Hello, world!")
        .unwrap();
    let (cpu_whole, cpu_steps) = fixture_logits(&ids, &Device::Cpu);
    let (gpu_whole, gpu_steps) = fixture_logits(&ids, &gpu());
    let (d_whole, d_steps) = (max_diff(&cpu_whole, &gpu_whole), max_diff(&cpu_steps, &gpu_steps));
    println!("fixture logits, max |cpu - cuda|: whole {d_whole:e}, cached {d_steps:e}");
    assert!(d_whole < 1e-3 && d_steps < 1e-3, "whole {d_whole}, cached {d_steps}");
}

#[test]
fn greedy_generation_is_the_same_text() {
    let dir = repo("tests/fixtures/tiny-gpt2");
    let texts: Vec<String> = [Device::Cpu, gpu()]
        .iter()
        .map(|dev| {
            let (model, tok) = gpt::load_dir(&dir, DType::F32, dev).unwrap();
            let mut sampler = gpt::Sampler::new(gpt::SamplingParams::default());
            let ids = tok.encode("Once upon a time").unwrap();
            tok.decode(&gpt::generate(&model, &ids, 40, &mut sampler, None).unwrap())
                .unwrap()
        })
        .collect();
    assert_eq!(texts[0], texts[1]);
}

#[test]
fn eval_perplexity_matches_the_cpu_within_1e_3() {
    let dir = repo("tests/fixtures/tiny-gpt2");
    let text = repo("tests/fixtures/tiny-gpt2/eval.txt");
    let run = |dev: &Device| {
        gpt_train::eval::eval_file(&dir, &text, &Default::default(), Some(32), Some(16), None, dev).unwrap()
    };
    let (cpu, cuda) = (run(&Device::Cpu), run(&gpu()));
    println!("eval mean NLL: cpu {} cuda {}", cpu.mean_nll, cuda.mean_nll);
    assert_eq!(cpu.tokens_scored, cuda.tokens_scored);
    assert!(
        (cpu.mean_nll - cuda.mean_nll).abs() < 1e-3,
        "cpu {} cuda {}",
        cpu.mean_nll,
        cuda.mean_nll
    );
}

/// Decode steps of sequences of different lengths in one batch (on CUDA: one launch appends and
/// attends for all of them, `gpt_kernels::infer::decode_attention`) give the CPU's logits.
#[test]
fn batched_decode_of_sequences_of_different_lengths_matches_the_cpu() {
    let dir = repo("tests/fixtures/tiny-gpt2");
    let prompts: [&[u32]; 3] = [&[5], &[17, 3, 99, 42, 7], &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]];
    let run = |dev: &Device| -> Vec<Tensor> {
        let (model, _) = gpt::load_dir(&dir, DType::F32, dev).unwrap();
        let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
        for (ids, cache) in prompts.iter().zip(caches.iter_mut()) {
            model
                .forward_step(&mut [SeqStep { tokens: ids, cache }], LogitsFor::Last)
                .unwrap();
        }
        (0..6u32)
            .map(|step| {
                let tokens: Vec<[u32; 1]> = (0..3u32).map(|b| [(step * 7 + b * 13 + 1) % 90]).collect();
                let mut steps: Vec<SeqStep> = tokens
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(tokens, cache)| SeqStep { tokens, cache })
                    .collect();
                let logits = model.forward_step(&mut steps, LogitsFor::Last).unwrap();
                logits.to_device(&Device::Cpu).unwrap()
            })
            .collect()
    };
    let (cpu, cuda) = (run(&Device::Cpu), run(&gpu()));
    for (step, (a, b)) in cpu.iter().zip(&cuda).enumerate() {
        assert_eq!(a.dims(), &[3, b.dims()[1]]);
        let d = max_diff(a, b);
        assert!(d < 1e-3, "decode step {step}: logits differ by {d}");
    }
}
