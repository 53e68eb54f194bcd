//! The fused ops against candle's own, forward and backward.

use super::*;
use crate::elementwise::gelu::fast_tanh;
use candle_core::{Device, Var, D};

use gpt_test_support as support;

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    support::max_abs_diff(a, b).expect("tensors of one shape")
}

#[test]
fn fast_tanh_is_accurate() {
    let worst = (-20_000..=20_000)
        .map(|i| i as f32 / 1000.0)
        .map(|x| (fast_tanh(x) as f64 - (x as f64).tanh()).abs())
        .fold(0.0, f64::max);
    assert!(worst < 2e-6, "{worst}");
}

#[test]
fn gelu_matches_candle_forward_and_backward() {
    let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, (7, 33), &Device::Cpu).unwrap())).unwrap();
    let g = Tensor::randn(0f32, 1.0, (7, 33), &Device::Cpu).unwrap();
    let (ours, theirs) = (gelu(&x).unwrap(), x.gelu().unwrap());
    assert!(max_diff(&ours, &theirs) < 1e-5);
    let ga = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let gb = (theirs * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let d = max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
    assert!(d < 1e-4, "{d}");
}

/// Squared ReLU fused against candle's `relu` then `sqr`: the same bits both ways (one product
/// forward, `2 x · dy` back), zeros included.
#[test]
fn relu2_matches_candle_forward_and_backward() {
    let mut values: Vec<f32> = support::uniform(7 * 33, 5).iter().map(|v| 3.0 * v).collect();
    values[..4].copy_from_slice(&[0.0, -0.0, -1.0, 1.0]);
    let x = Var::from_tensor(&Tensor::from_vec(values, (7, 33), &Device::Cpu).unwrap()).unwrap();
    let g = Tensor::from_vec(support::uniform(7 * 33, 6), (7, 33), &Device::Cpu).unwrap();
    let (ours, theirs) = (relu2(&x).unwrap(), x.relu().unwrap().sqr().unwrap());
    assert_eq!(max_diff(&ours, &theirs), 0.0);
    let ga = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let gb = (theirs * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let d = max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
    assert!(d <= 1e-6, "{d}");
    let zeros = ga.get(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(
        zeros[..3].iter().all(|&z| z == 0.0),
        "no gradient at or below zero: {zeros:?}"
    );
}

/// Forward values and the gradients of every input against candle's composite ops.
#[test]
fn add_tiled_and_layer_norm_match_candle() {
    let dev = &Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (3, 5, 8), dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 8), dev).unwrap()).unwrap();
    let gamma = Var::from_tensor(&Tensor::randn(1f32, 0.5, 8, dev).unwrap()).unwrap();
    let beta = Var::from_tensor(&Tensor::randn(0f32, 0.5, 8, dev).unwrap()).unwrap();
    let g = Tensor::randn(0f32, 1.0, (3, 5, 8), dev).unwrap();
    let run = |fused: bool| {
        let h = if fused { add_tiled(&x, &b) } else { x.broadcast_add(&b) }.unwrap();
        let y = if fused {
            layer_norm(&h, &gamma, &beta, 1e-5)
        } else {
            candle_nn::ops::layer_norm_slow(&h, &gamma, &beta, 1e-5)
        }
        .unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let get = |v: &Var| grads.get(v).unwrap().clone();
        (y, [get(&x), get(&b), get(&gamma), get(&beta)])
    };
    let ((ya, ga), (yb, gb)) = (run(true), run(false));
    assert!(max_diff(&ya, &yb) < 1e-5);
    for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
        assert_eq!(a.shape(), b.shape());
        assert!(max_diff(a, b) < 1e-4, "gradient {i}: {}", max_diff(a, b));
    }
}

/// RMSNorm, RoPE and the gated activations, fused, against candle-nn's composites: values and
/// the gradients of every input, through candle's backward pass and through the tape's.
#[test]
fn rms_norm_rope_and_gated_activations_match_candles_composites() {
    let dev = &Device::Cpu;
    let (n, heads, hd, inner) = (6, 3, 8, 10);
    let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (n, heads * hd), dev).unwrap()).unwrap();
    let gamma = Var::from_tensor(&Tensor::randn(1f32, 0.5, heads * hd, dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.3, (heads * hd, 2 * inner), dev).unwrap()).unwrap();
    let angles = Tensor::randn(0f32, 3.0, (n, hd / 2), dev).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let g_rot = Tensor::randn(0f32, 1.0, (1, n, heads, hd), dev).unwrap();
    let g_out = Tensor::randn(0f32, 1.0, (n, inner), dev).unwrap();
    for act in [GateActivation::Silu, GateActivation::GeluTanh] {
        // (rotated, gated): the norm's output rotated as heads, and a gated MLP's activation of
        // the norm's output; the loss reads both.
        let forward = |fused: bool| {
            let h = match fused {
                true => rms_norm(&x, &gamma, 1e-5),
                false => candle_nn::ops::rms_norm_slow(&x, &gamma, 1e-5),
            }
            .unwrap();
            // The plain ops as entries of a recording tape (outside one, just the ops).
            let heads4 = tape::candle_ops(&[&h], |a| a[0].reshape((1, n, heads, hd))).unwrap();
            let rotated = match fused {
                true => rope(&heads4, &cos, &sin),
                false => candle_nn::rotary_emb::rope_slow(&heads4.transpose(1, 2).unwrap(), &cos, &sin)
                    .and_then(|r| r.transpose(1, 2)),
            }
            .unwrap();
            let up = tape::candle_ops(&[&h, &w], |a| a[0].matmul(&a[1])).unwrap(); // (N, 2 I)
            let gated_out = match fused {
                true => gated(&up, act).unwrap(),
                false => {
                    let (a, b) = (up.narrow(1, 0, inner).unwrap(), up.narrow(1, inner, inner).unwrap());
                    let a = match act {
                        GateActivation::Silu => candle_nn::ops::silu(&a).unwrap(),
                        GateActivation::GeluTanh => a.gelu().unwrap(),
                    };
                    (a * b).unwrap()
                }
            };
            let loss = tape::candle_ops(&[&rotated, &gated_out], |a| {
                a[0].mul(&g_rot)?.sum_all()? + a[1].mul(&g_out)?.sum_all()?
            })
            .unwrap();
            (rotated, gated_out, loss)
        };
        let (ra, ya, la) = forward(true);
        let (rb, yb, lb) = forward(false);
        assert!(max_diff(&ra, &rb) < 1e-5, "{act:?}: rope {}", max_diff(&ra, &rb));
        assert!(max_diff(&ya, &yb) < 1e-5, "{act:?}: gated {}", max_diff(&ya, &yb));
        let candle_grads = |loss: &Tensor| {
            let g = loss.backward().unwrap();
            [&x, &gamma, &w].map(|v| g.get(v).unwrap().clone())
        };
        let (ga, gb) = (candle_grads(&la), candle_grads(&lb));
        // The tape's backward pass over the fused ops gives candle's over them.
        let (loss, tape) = tape::record(|| Ok::<_, candle_core::Error>(forward(true).2)).unwrap();
        let gt: Vec<Tensor> = tape
            .backward(&loss, 1.0, &[&x, &gamma, &w])
            .unwrap()
            .into_iter()
            .map(|g| g.expect("a gradient for every leaf"))
            .collect();
        for (i, ((a, b), t)) in ga.iter().zip(&gb).zip(&gt).enumerate() {
            assert!(max_diff(a, b) < 1e-4, "{act:?}: gradient {i}: {}", max_diff(a, b));
            assert_eq!(max_diff(a, t), 0.0, "{act:?}: gradient {i} on the tape");
        }
    }
}

/// Grouped-query heads repeated for their groups: the fused op's values and gradient (each
/// key/value head's the sum of its group's) equal candle's broadcast and concatenation; head
/// counts that do not group are refused.
#[test]
fn repeated_kv_heads_match_candles_broadcast_and_sum_back() {
    let dev = &Device::Cpu;
    let (rows, nh, nkv, hs) = (5, 6, 2, 4);
    let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, (nh + 2 * nkv) * hs), dev).unwrap()).unwrap();
    let g = Tensor::randn(0f32, 1.0, (rows, 3 * nh * hs), dev).unwrap();
    let composite = {
        let part = |start: usize, heads: usize| qkv.narrow(1, start * hs, heads * hs).unwrap();
        let repeat = |start: usize| {
            part(start, nkv)
                .reshape((rows, nkv, 1, hs))
                .and_then(|t| t.broadcast_as((rows, nkv, nh / nkv, hs)))
                .and_then(|t| t.reshape((rows, nh * hs)))
                .unwrap()
        };
        Tensor::cat(&[part(0, nh), repeat(nh), repeat(nh + nkv)], 1).unwrap()
    };
    let fused = repeat_kv_heads(&qkv, nh, nkv).unwrap();
    assert_eq!(max_diff(&fused, &composite), 0.0);
    let grad = |y: &Tensor| {
        (y * &g)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
            .get(&qkv)
            .unwrap()
            .clone()
    };
    let d = max_diff(&grad(&fused), &grad(&composite));
    assert!(d < 1e-6, "{d}");
    for (nh, nkv) in [(6, 4), (6, 0)] {
        let err = repeat_kv_heads(&qkv, nh, nkv).expect_err("heads that do not group");
        assert!(err.to_string().contains("heads"), "{err}");
    }
}

#[test]
fn cross_entropy_matches_candle_forward_and_backward() {
    let dev = &Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 3.0, (37, 301), dev).unwrap()).unwrap();
    let targets = Tensor::new((0..37u32).map(|i| (i * 97) % 301).collect::<Vec<_>>(), dev).unwrap();
    let ours = cross_entropy(&x, &targets, 0.0).unwrap();
    let theirs = candle_nn::loss::cross_entropy(&x, &targets).unwrap();
    let (a, b) = (ours.to_scalar::<f32>().unwrap(), theirs.to_scalar::<f32>().unwrap());
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    // Scaled by 3 after the loss, so that the incoming gradient is not 1.
    let ga = (ours * 3.0).unwrap().backward().unwrap();
    let gb = (theirs * 3.0).unwrap().backward().unwrap();
    let d = max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
    assert!(d < 1e-6, "{d}");
    let bad = Tensor::new(&[0u32, 301], dev).unwrap();
    let err = cross_entropy(&x.narrow(0, 0, 2).unwrap(), &bad, 0.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("301") && err.contains("vocabulary"), "{err}");
}

#[test]
fn causal_softmax_matches_mask_and_softmax_forward_and_backward() {
    for (t_q, t_k) in [(5, 5), (3, 8), (1, 4)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 3.0, (2, 3, t_q, t_k), &Device::Cpu).unwrap()).unwrap();
        let g = Tensor::randn(0f32, 1.0, (2, 3, t_q, t_k), &Device::Cpu).unwrap();
        let mask = causal_mask(t_q, t_k - t_q, DType::F32, &Device::Cpu).unwrap();
        let reference = candle_nn::ops::softmax(&x.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        let ours = causal_softmax(&x, true).unwrap();
        assert!(max_diff(&ours, &reference) < 1e-6, "{t_q}x{t_k}");
        let ga = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (reference * &g).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap()) < 1e-5, "{t_q}x{t_k}");
    }
}

#[test]
fn dropout_drops_p_scales_the_rest_and_masks_the_gradient_alike() {
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (64, 256), &Device::Cpu).unwrap()).unwrap();
    let g = Tensor::randn(0f32, 1.0, (64, 256), &Device::Cpu).unwrap();
    let p = 0.25f32;
    let y = dropout(&x, p, 42, 0).unwrap();
    let (xs, ys) = (
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    let dropped = ys.iter().filter(|&&v| v == 0.0).count() as f32 / ys.len() as f32;
    assert!((dropped - p).abs() < 0.01, "{dropped}");
    for (a, b) in xs.iter().zip(&ys) {
        assert!(*b == 0.0 || (b - a / (1.0 - p)).abs() < 1e-6);
    }
    // The fused op equals the host-made mask (the path of other devices and dtypes).
    let op = crate::elementwise::dropout::Dropout { key: 42, first: 0, p };
    assert_eq!(max_diff(&y, &(x.as_tensor() * op.mask(&x).unwrap()).unwrap()), 0.0);
    // Backward: the same mask on the gradient.
    let grads = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let expected = (g * op.mask(&x).unwrap()).unwrap();
    assert_eq!(max_diff(grads.get(&x).unwrap(), &expected), 0.0);
    // Rows 32.. alone, as a shard starting at row 32, get the batch's masks.
    let tail = dropout(&x.narrow(0, 32, 32).unwrap(), p, 42, 32).unwrap();
    let whole = dropout(&x, p, 42, 0).unwrap();
    assert_eq!(max_diff(&tail, &whole.narrow(0, 32, 32).unwrap()), 0.0);
}

/// tests/fixtures/label_smoothing.json, written by PyTorch (make_label_smoothing.py).
#[test]
fn label_smoothing_matches_pytorch_forward_and_backward() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/label_smoothing.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rows: Vec<Vec<f32>> = serde_json::from_value(fixture["logits"].clone()).unwrap();
    let targets: Vec<u32> = serde_json::from_value(fixture["targets"].clone()).unwrap();
    let dev = &Device::Cpu;
    let targets = Tensor::new(targets, dev).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let eps = case["eps"].as_f64().unwrap() as f32;
        let want_loss = case["loss"].as_f64().unwrap() as f32;
        let want_grad = Tensor::new(
            serde_json::from_value::<Vec<Vec<f32>>>(case["grad"].clone()).unwrap(),
            dev,
        )
        .unwrap();
        // f32 on the CPU takes the fused op, f64 the composite that other devices use.
        for dtype in [DType::F32, DType::F64] {
            let x = Var::from_tensor(&Tensor::new(rows.clone(), dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let loss = cross_entropy(&x, &targets, eps).unwrap();
            let got = loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
            assert!(
                (got - want_loss).abs() < 1e-5,
                "{dtype:?}, eps {eps}: loss {got} vs PyTorch {want_loss}"
            );
            let grads = loss.backward().unwrap();
            let d = max_diff(&grads.get(&x).unwrap().to_dtype(DType::F32).unwrap(), &want_grad);
            assert!(d < 1e-6, "{dtype:?}, eps {eps}: gradient differs from PyTorch's by {d}");
        }
    }
}

/// The fused attention of new tokens against their caches, for sequences with different cached
/// lengths at once (keys and values read through strided views of larger buffers, as the KV cache
/// holds them), against softmax(q k^T / sqrt(hs) + causal mask) v with candle's ops; head sizes
/// that take the SIMD kernels (32, 64, 128) and the plain one (24). Each sequence's rows equal,
/// bit for bit, those it gets alone, and those it gets one token at a time (as in decoding: the
/// SIMD kernels group a prompt's rows, never changing a row's arithmetic). On every instruction
/// set the host runs, each within rounding of the portable path.
#[test]
fn cached_attention_matches_candle() {
    for &simd in Simd::available() {
        cached_attention_matches_candle_on(simd);
    }
    eprintln!("instruction sets checked: {:?}", Simd::available());
}

/// Grouped-query attention (fewer key/value heads than query heads, as Llama 3 and Qwen hold
/// them) gives, bit for bit, what the same attention gives with every key/value head repeated for
/// its group of query heads (the multi-head kernel, checked against candle's ops above), on every
/// instruction set the host runs and for head sizes of each kernel, over a prompt's rows and a
/// decode step's (where AVX-512 shares each key/value head among its query heads); a head count that the
/// key/value heads do not divide is an error.
#[test]
fn grouped_attention_equals_attention_with_the_kv_heads_repeated() {
    let dev = Device::Cpu;
    for &simd in Simd::available() {
        // A prompt's rows, then a decode step of 64 sequences (one token each: AVX-512 takes a
        // task per key/value head and up to 4 of its query heads, 2 of 128 values, where that
        // makes two tasks a thread: here on up to 32 threads; 5 and 7 a group split).
        let shapes = [
            (4usize, 2usize, 64usize),
            (6, 2, 32),
            (3, 1, 128),
            (4, 1, 24),
            (9, 3, 64),
            (7, 1, 32),
            (5, 1, 128),
        ];
        let prompt = (vec![1usize, 6, 3], vec![4usize, 11, 0]);
        let decode = (vec![1usize; 64], (0..64).map(|i| i * 7 % 41).collect::<Vec<usize>>());
        for ((n_head, n_kv, hs), (lens, cached)) in shapes
            .into_iter()
            .flat_map(|s| [(s, prompt.clone()), (s, decode.clone())])
        {
            let n: usize = lens.iter().sum();
            let (qw, kvw) = (n_head * hs, n_kv * hs);
            let qkv = Tensor::randn(0f32, 1.0, (n, qw + 2 * kvw), &dev).unwrap();
            let group = n_head / n_kv;
            // Each key/value head repeated for its group: (.., n_kv, hs) -> (.., n_head, hs).
            let repeat = |t: &Tensor, dim: usize| {
                let mut dims = t.dims().to_vec();
                let parts: Vec<Tensor> = (0..n_kv)
                    .flat_map(|h| std::iter::repeat_n(t.narrow(dim, h, 1).unwrap(), group))
                    .collect();
                dims[dim] = n_head;
                Tensor::cat(&parts, dim).unwrap()
            };
            let q = qkv.narrow(1, 0, qw).unwrap();
            let k = repeat(&qkv.narrow(1, qw, kvw).unwrap().reshape((n, n_kv, hs)).unwrap(), 1);
            let v = repeat(
                &qkv.narrow(1, qw + kvw, kvw).unwrap().reshape((n, n_kv, hs)).unwrap(),
                1,
            );
            let wide = Tensor::cat(&[q, k.reshape((n, qw)).unwrap(), v.reshape((n, qw)).unwrap()], 1).unwrap();
            let (mut kv, mut wide_kv) = (Vec::new(), Vec::new());
            for (&len, &offset) in lens.iter().zip(&cached) {
                let t = offset + len;
                let k = Tensor::randn(0f32, 1.0, (n_kv, t, hs), &dev).unwrap();
                let v = Tensor::randn(0f32, 1.0, (n_kv, t, hs), &dev).unwrap();
                wide_kv.push(CachedKv::whole(repeat(&k, 0), repeat(&v, 0)).unwrap());
                kv.push(CachedKv::whole(k, v).unwrap());
            }
            let scale = 1.0 / (hs as f32).sqrt();
            let got = cached_attention_on(simd, &qkv, &lens, &kv, n_head, n_kv, scale).unwrap();
            let expected = cached_attention_on(simd, &wide, &lens, &wide_kv, n_head, n_head, scale).unwrap();
            assert_eq!(got.dims(), [n, qw]);
            assert_eq!(
                max_diff(&got, &expected),
                0.0,
                "{simd:?}, {n_head} heads, {n_kv} kv heads of {hs}, lengths {lens:?}"
            );
        }
    }
    // 3 query heads and 2 key/value heads of 8 fill the width, but 2 does not divide 3.
    let qkv = Tensor::zeros((2, (3 + 2 * 2) * 8), candle_core::DType::F32, &dev).unwrap();
    let kv = CachedKv::whole(
        Tensor::zeros((2, 2, 8), candle_core::DType::F32, &dev).unwrap(),
        Tensor::zeros((2, 2, 8), candle_core::DType::F32, &dev).unwrap(),
    )
    .unwrap();
    assert!(cached_attention_on(Simd::Portable, &qkv, &[2], &[kv], 3, 2, 1.0).is_err());
}

/// A sliding window and soft-capped scores (Mistral's and Gemma's attention): each row equals a
/// softmax written out here over exactly the keys of its window, `cap * tanh(s / cap)` of the
/// scaled scores, on every instruction set the host runs (all take the same masked path); a
/// window of 0 is an error.
#[test]
fn masked_attention_sees_only_its_window_and_caps_its_scores() {
    let dev = Device::Cpu;
    let (n_head, n_kv, hs) = (4usize, 2usize, 32usize);
    let (qw, kvw) = (n_head * hs, n_kv * hs);
    let (lens, cached) = ([1usize, 7, 3], [9usize, 2, 0]);
    let n: usize = lens.iter().sum();
    let qkv = Tensor::randn(0f32, 1.0, (n, qw + 2 * kvw), &dev).unwrap();
    let kv: Vec<CachedKv> = lens
        .iter()
        .zip(&cached)
        .map(|(&len, &offset)| {
            let t = offset + len;
            let k = Tensor::randn(0f32, 1.0, (n_kv, t, hs), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (n_kv, t, hs), &dev).unwrap();
            CachedKv::whole(k, v).unwrap()
        })
        .collect();
    let q = qkv.to_vec2::<f32>().unwrap();
    let scale = 0.3f32;
    for masking in [
        Masking {
            window: Some(3),
            softcap: None,
        },
        Masking {
            window: None,
            softcap: Some(1.5),
        },
        Masking {
            window: Some(1),
            softcap: Some(2.0),
        },
        Masking {
            window: Some(100),
            softcap: None,
        },
    ] {
        let mut expected = vec![vec![0f32; qw]; n];
        let mut row = 0;
        for ((&len, &offset), kv) in lens.iter().zip(&cached).zip(&kv) {
            let (keys, values) = (
                kv.keys[0].to_vec3::<f32>().unwrap(),
                kv.values[0].to_vec3::<f32>().unwrap(),
            );
            for i in 0..len {
                let pos = offset + i;
                let first = masking.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..n_head {
                    let g = h / (n_head / n_kv);
                    let scores: Vec<f32> = (first..=pos)
                        .map(|j| {
                            let s: f32 = (0..hs).map(|d| q[row][h * hs + d] * keys[g][j][d]).sum::<f32>() * scale;
                            masking.softcap.map_or(s, |c| (s / c).tanh() * c)
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    for d in 0..hs {
                        expected[row][h * hs + d] = (first..=pos).zip(&e).map(|(j, p)| p / sum * values[g][j][d]).sum();
                    }
                }
                row += 1;
            }
        }
        let expected = Tensor::new(expected, &dev).unwrap();
        for &simd in Simd::available() {
            let got = cached_attention_masked(simd, &qkv, &lens, &kv, n_head, n_kv, scale, masking).unwrap();
            let d = max_diff(&got, &expected);
            assert!(d < 1e-5, "{simd:?}, {masking:?}: max diff {d}");
        }
    }
    let zero = Masking {
        window: Some(0),
        softcap: None,
    };
    assert!(cached_attention_masked(Simd::Portable, &qkv, &lens, &kv, n_head, n_kv, scale, zero).is_err());
}

fn cached_attention_matches_candle_on(simd: Simd) {
    let cached_attention = |qkv: &Tensor, lens: &[usize], kv: &[CachedKv], n_head, scale| {
        cached_attention_on(simd, qkv, lens, kv, n_head, n_head, scale)
    };
    let dev = Device::Cpu;
    for (n_head, hs) in [(3usize, 64usize), (2, 24), (2, 32), (1, 128)] {
        let c = n_head * hs;
        let (lens, cached) = ([1usize, 7, 2], [5usize, 13, 9]);
        let n: usize = lens.iter().sum();
        let qkv = Tensor::randn(0f32, 1.0, (n, 3 * c), &dev).unwrap();
        let mut kv = Vec::new();
        let mut expected = Vec::new();
        let mut row0 = 0;
        for (&len, &offset) in lens.iter().zip(&cached) {
            let t = offset + len;
            // (nh, T, hs) views into buffers with room for 7 more positions.
            let buffer = |seed: f32| {
                let full = (Tensor::randn(0f32, 1.0, (n_head, t + 7, hs), &dev).unwrap() * seed as f64).unwrap();
                full.narrow(1, 0, t).unwrap()
            };
            let (k, v) = (buffer(1.0), buffer(0.5));
            let heads = |i: usize| {
                qkv.narrow(0, row0, len)
                    .unwrap()
                    .narrow(1, i * c, c)
                    .unwrap()
                    .reshape((len, n_head, hs))
                    .unwrap()
                    .transpose(0, 1)
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let q = heads(0);
            let att = (q.matmul(&k.t().unwrap()).unwrap() / (hs as f64).sqrt()).unwrap(); // (nh, len, T)
            let mask: Vec<f32> = (0..len)
                .flat_map(|i| (0..t).map(move |j| if j <= offset + i { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let mask = Tensor::from_vec(mask, (len, t), &dev).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att.broadcast_add(&mask).unwrap()).unwrap();
            let y = att.matmul(&v.contiguous().unwrap()).unwrap(); // (nh, len, hs)
            expected.push(y.transpose(0, 1).unwrap().reshape((len, c)).unwrap());
            kv.push(CachedKv::whole(k, v).unwrap());
            row0 += len;
        }
        let expected = Tensor::cat(&expected, 0).unwrap();
        let got = cached_attention(&qkv, &lens, &kv, n_head, 1.0 / (hs as f32).sqrt()).unwrap();
        let d = max_diff(&got, &expected);
        assert!(d < 1e-5, "{simd:?}, n_head={n_head} hs={hs}: {d}");
        let portable = cached_attention_on(
            Simd::Portable,
            &qkv,
            &lens,
            &kv,
            n_head,
            n_head,
            1.0 / (hs as f32).sqrt(),
        )
        .unwrap();
        let d = max_diff(&got, &portable);
        assert!(
            d < 1e-6,
            "{simd:?} against the portable path, n_head={n_head} hs={hs}: {d}"
        );
        // The same caches in blocks of 8 and of 16 positions (the KV cache's layout on the CPU):
        // the same bits.
        for block in [8, 16] {
            let blocks = |x: &Tensor| -> Vec<Tensor> {
                let t = x.dims()[1];
                (0..t.div_ceil(block))
                    .map(|b| {
                        let out = Tensor::zeros((n_head, block, hs), DType::F32, &dev).unwrap();
                        let part = x.narrow(1, b * block, block.min(t - b * block)).unwrap();
                        out.slice_set(&part.contiguous().unwrap(), 1, 0).unwrap();
                        out
                    })
                    .collect()
            };
            let paged: Vec<CachedKv> = (kv.iter())
                .map(|kv| CachedKv {
                    keys: blocks(&kv.keys[0]),
                    values: blocks(&kv.values[0]),
                    len: kv.len,
                    dropped: 0,
                })
                .collect();
            let scale = 1.0 / (hs as f32).sqrt();
            let in_blocks = cached_attention(&qkv, &lens, &paged, n_head, scale).unwrap();
            assert_eq!(max_diff(&in_blocks, &got), 0.0, "{simd:?}, hs={hs}, blocks of {block}");
            // Blocks stored in f16: the same bits as f32 blocks holding the rounded values
            // (read as f32, the same operations), and within f16's rounding of the f32 result.
            let cast = |dtype: DType| -> Vec<CachedKv> {
                let cast = |blocks: &[Tensor]| blocks.iter().map(|b| b.to_dtype(dtype).unwrap()).collect();
                (paged.iter())
                    .map(|kv| CachedKv {
                        keys: cast(&kv.keys),
                        values: cast(&kv.values),
                        ..kv.clone()
                    })
                    .collect()
            };
            let (half, rounded) = (cast(DType::F16), cast(DType::F16));
            let rounded: Vec<CachedKv> = (rounded.into_iter())
                .map(|kv| CachedKv {
                    keys: kv.keys.iter().map(|b| b.to_dtype(DType::F32).unwrap()).collect(),
                    values: kv.values.iter().map(|b| b.to_dtype(DType::F32).unwrap()).collect(),
                    ..kv
                })
                .collect();
            let from_half = cached_attention(&qkv, &lens, &half, n_head, scale).unwrap();
            let from_rounded = cached_attention(&qkv, &lens, &rounded, n_head, scale).unwrap();
            assert_eq!(
                max_diff(&from_half, &from_rounded),
                0.0,
                "{simd:?}, hs={hs}: f16 blocks"
            );
            let d = max_diff(&from_half, &got);
            assert!(d > 0.0 && d < 5e-3, "{simd:?}, hs={hs}: f16 blocks {d} from f32's");
            // A cache whose blocks mix f16 and f32 is an error.
            let mut mixed = half.clone();
            mixed[0].values = paged[0].values.clone();
            assert!(cached_attention(&qkv, &lens, &mixed, n_head, scale).is_err());
            // Without its first block, a cache that attention reads from position 0 is refused.
            let mut short = paged.clone();
            for kv in short.iter_mut().filter(|kv| kv.keys.len() > 1) {
                kv.keys.remove(0);
                kv.values.remove(0);
                kv.dropped = 1;
            }
            assert!(cached_attention(&qkv, &lens, &short, n_head, scale).is_err());
        }
        // Batch invariance: the middle sequence alone, then token by token.
        let scale = 1.0 / (hs as f32).sqrt();
        let alone = cached_attention(&qkv.narrow(0, 1, 7).unwrap(), &[7], &kv[1..2], n_head, scale).unwrap();
        assert_eq!(max_diff(&alone, &got.narrow(0, 1, 7).unwrap()), 0.0);
        for i in 0..7 {
            let (k, v) = (&kv[1].keys[0], &kv[1].values[0]);
            let t = cached[1] + i + 1;
            let seen = CachedKv::whole(k.narrow(1, 0, t).unwrap(), v.narrow(1, 0, t).unwrap()).unwrap();
            let one = cached_attention(&qkv.narrow(0, 1 + i, 1).unwrap(), &[1], &[seen], n_head, scale).unwrap();
            assert_eq!(
                max_diff(&one, &got.narrow(0, 1 + i, 1).unwrap()),
                0.0,
                "hs={hs}: token {i}"
            );
        }
    }
    // Lengths that do not add up to the rows are an error, not a panic.
    let qkv = Tensor::zeros((3, 3 * 64), DType::F32, &dev).unwrap();
    let kv = Tensor::zeros((1, 3, 64), DType::F32, &dev).unwrap();
    assert!(cached_attention(&qkv, &[2], &[CachedKv::whole(kv.clone(), kv).unwrap()], 1, 0.125).is_err());
}

/// Forward and both gradients against candle's matmul, for a transposed view of GPT-2's
/// `(in, out)` weight (as training holds it) and for a contiguous `(out, in)` one (the LM head),
/// on shapes with partial panels and tiles.
#[test]
fn linear_product_and_its_gradients_match_candles_matmul() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (m, k, n) in [(1, 5, 3), (13, 64, 40), (70, 48, 33), (40, 96, 130)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (m, k), &dev)?)?;
        let w_in_out = Var::from_tensor(&Tensor::randn(0f32, 1.0, (k, n), &dev)?)?;
        let w_out_in = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, k), &dev)?)?;
        let g = Tensor::randn(0f32, 1.0, (m, n), &dev)?;
        for w in [w_in_out.as_tensor().t()?, w_out_in.as_tensor().clone()] {
            let ours = linear_product(x.as_tensor(), &w, Autocast::Off)?;
            let theirs = x.as_tensor().matmul(&w.t()?)?;
            let scale = (k as f32).sqrt();
            assert!(
                support::max_abs_diff(&ours, &theirs)? < 1e-5 * scale,
                "({m}, {k}, {n}) forward"
            );
            let grads_ours = (ours * &g)?.sum_all()?.backward()?;
            let grads_theirs = (theirs * &g)?.sum_all()?.backward()?;
            for var in [&x, &w_in_out, &w_out_in] {
                match (grads_ours.get(var.as_tensor()), grads_theirs.get(var.as_tensor())) {
                    (Some(a), Some(b)) => {
                        let d = support::max_abs_diff(a, b)?;
                        assert!(d < 1e-4 * scale, "({m}, {k}, {n}): gradient differs by {d}");
                    }
                    (None, None) => {}
                    _ => panic!("({m}, {k}, {n}): a gradient on one side only"),
                }
            }
        }
    }
    Ok(())
}

/// The fused LM head and cross-entropy against the head's product then the fused cross-entropy:
/// the loss with and without gradients, and the gradients of the hidden states and of the head,
/// for several chunks of rows, a transposed head and label smoothing.
#[test]
fn lm_head_loss_matches_the_head_then_the_cross_entropy() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (n, c, vocab) = (1100, 24, 97); // three chunks of rows, the last partial
    for (eps, transposed) in [(0.0f32, false), (0.1, true)] {
        let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c), &dev)?)?;
        let w_var = if transposed {
            Var::from_tensor(&Tensor::randn(0f32, 0.5, (c, vocab), &dev)?)?
        } else {
            Var::from_tensor(&Tensor::randn(0f32, 0.5, (vocab, c), &dev)?)?
        };
        let w = if transposed {
            w_var.as_tensor().t()?
        } else {
            w_var.as_tensor().clone()
        };
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % vocab as u32).collect();
        let targets = Tensor::new(ids.as_slice(), &dev)?;
        let fused = lm_head_loss(h.as_tensor(), &w, &targets, eps, true, Autocast::Off)?;
        let plain = cross_entropy(&h.as_tensor().matmul(&w.t()?)?, &targets, eps)?;
        let (a, b) = (fused.to_scalar::<f32>()?, plain.to_scalar::<f32>()?);
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "eps {eps}: loss {a} vs {b}");
        let no_grad = lm_head_loss(h.as_tensor(), &w, &targets, eps, false, Autocast::Off)?.to_scalar::<f32>()?;
        assert_eq!(no_grad, a, "eps {eps}: the loss differs without gradients");
        let (gf, gp) = ((fused * 3.0)?.backward()?, (plain * 3.0)?.backward()?);
        for var in [&h, &w_var] {
            let (x, y) = (gf.get(var.as_tensor()), gp.get(var.as_tensor()));
            let (Some(x), Some(y)) = (x, y) else {
                panic!("eps {eps}: a gradient is missing")
            };
            let d = max_diff(x, y);
            let size = support::max_abs_diff(y, &y.zeros_like()?)?;
            assert!(
                d < 1e-5 * size.max(1e-3) + 1e-7,
                "eps {eps}: gradient differs by {d} (size {size})"
            );
        }
    }
    Ok(())
}

/// The tiled window attention against candle's composite (q kᵀ, additive mask, softmax, the
/// same dropout masks as a tensor, the product with v), forward and the gradient of `qkv`, on
/// every instruction set this CPU has: several query blocks with a partial last one, head sizes
/// that are and are not whole vectors (read where they are, or copied), with and without dropout.
#[test]
fn window_attention_matches_candles_composite() -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    for &simd in Simd::available() {
        for (b, t, nh, hs, p) in [
            (2, 150, 2, 24, 0.0),
            (2, 150, 2, 24, 0.3),
            (2, 150, 2, 32, 0.0),
            (2, 150, 2, 32, 0.3),
            (1, 40, 3, 64, 0.1),
            (3, 1, 1, 16, 0.0),
        ] {
            let c = nh * hs;
            let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, 3 * c), dev)?)?;
            let g = Tensor::randn(0f32, 1.0, (b, t, c), dev)?;
            let scale = 1.0 / (hs as f32).sqrt();
            let (key, first_row) = (99, 3usize);
            let rows = qkv.reshape((b * t, 3 * c))?;
            let ours = window_attention(simd, &rows, t, nh, scale, p, key, first_row, None)?.reshape((b, t, c))?;
            let heads = |i: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(2, i * c, c)?
                    .reshape((b, t, nh, hs))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let att = (heads(0)?.matmul(&heads(1)?.t()?)? * scale as f64)?;
            let att = candle_nn::ops::softmax(&att.broadcast_add(&causal_mask(t, 0, DType::F32, dev)?)?, D::Minus1)?;
            let drop = crate::elementwise::dropout::Dropout {
                key,
                first: (first_row * nh * t * t) as u64,
                p,
            };
            let att = if p > 0.0 { (&att * drop.mask(&att)?)? } else { att };
            let theirs = att.matmul(&heads(2)?)?.transpose(1, 2)?.reshape((b, t, c))?;
            let what = format!("{simd:?} ({b}, {t}, {nh} x {hs}) p {p}");
            let d = support::max_abs_diff(&ours, &theirs)?;
            assert!(d < 1e-5, "{what}: forward differs by {d}");
            let ga = (ours * &g)?.sum_all()?.backward()?;
            let gb = (theirs * &g)?.sum_all()?.backward()?;
            let d = support::max_abs_diff(ga.get(&qkv).expect("a gradient"), gb.get(&qkv).expect("a gradient"))?;
            assert!(d < 1e-4, "{what}: gradient differs by {d}");
        }
    }
    Ok(())
}

/// Packed windows: each sequence's rows get, forward and backward, what that sequence gets in a
/// window of its own (no attention across sequences, so no gradient across them either), and
/// with dropout what candle's composite gets under [`segment_mask`].
#[test]
fn packed_window_attention_keeps_each_sequence_to_itself() -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let (t, nh, hs) = (70, 2, 24);
    let c = nh * hs;
    let scale = 1.0 / (hs as f32).sqrt();
    // Two windows: three sequences (one of a single row), then one sequence and padding's own.
    let lens: [&[usize]; 2] = [&[23, 1, 46], &[50, 20]];
    let mut positions = Vec::new();
    for window in lens {
        for &len in window {
            positions.extend(0..len as u32);
        }
    }
    let starts = segment_starts(&positions, t)?;
    for &simd in Simd::available() {
        let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2 * t, 3 * c), dev)?)?;
        let g = Tensor::randn(0f32, 1.0, (2 * t, c), dev)?;
        let ours = window_attention(simd, &qkv, t, nh, scale, 0.0, 0, 0, Some(starts.clone()))?;
        let grads = (&ours * &g)?.sum_all()?.backward()?;
        let dqkv = grads.get(&qkv).expect("a gradient");
        let mut row = 0;
        for window in lens {
            for &len in window {
                let alone = Var::from_tensor(&qkv.narrow(0, row, len)?)?;
                let y = window_attention(simd, &alone, len, nh, scale, 0.0, 0, 0, None)?;
                let what = format!("{simd:?}: the sequence of {len} at row {row}");
                let d = max_diff(&ours.narrow(0, row, len)?, &y);
                assert!(d < 1e-5, "{what}: forward differs by {d}");
                let ga = (y * g.narrow(0, row, len)?)?.sum_all()?.backward()?;
                let d = max_diff(&dqkv.narrow(0, row, len)?, ga.get(&alone).expect("a gradient"));
                assert!(d < 1e-5, "{what}: gradient differs by {d}");
                row += len;
            }
        }
        // Under dropout, against the composite with the packed windows' mask.
        let (p, key) = (0.2, 5);
        let ours = window_attention(simd, &qkv, t, nh, scale, p, key, 0, Some(starts.clone()))?.reshape((2, t, c))?;
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, i * c, c)?
                .reshape((2, t, nh, hs))?
                .transpose(1, 2)?
                .contiguous()
        };
        let att = (heads(0)?.matmul(&heads(1)?.t()?)? * scale as f64)?;
        let att = att.broadcast_add(&segment_mask(&starts, t, DType::F32, dev)?)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let drop = crate::elementwise::dropout::Dropout { key, first: 0, p };
        let att = (&att * drop.mask(&att)?)?;
        let theirs = att.matmul(&heads(2)?)?.transpose(1, 2)?.reshape((2, t, c))?;
        let d = max_diff(&ours, &theirs);
        assert!(d < 1e-5, "{simd:?} under dropout: forward differs by {d}");
        let g = g.reshape((2, t, c))?;
        let ga = (ours * &g)?.sum_all()?.backward()?;
        let gb = (theirs * &g)?.sum_all()?.backward()?;
        let d = max_diff(ga.get(&qkv).expect("a gradient"), gb.get(&qkv).expect("a gradient"));
        assert!(d < 1e-4, "{simd:?} under dropout: gradient differs by {d}");
    }
    Ok(())
}

/// Positions that do not restart at 0 or go up by one are refused, naming the place.
#[test]
fn segment_starts_refuse_positions_that_skip() {
    let ok = segment_starts(&[0, 1, 2, 0, 0, 1, 0, 1], 4).expect("valid positions");
    assert_eq!(&ok[..], &[0, 0, 0, 3, 0, 0, 2, 2]);
    for (bad, place) in [
        (&[0, 2, 3, 4][..], "row 1"),
        (&[1, 2, 3, 4], "row 0"),
        (&[0, 1, 2, 3, 4, 5, 6, 7], "window 1, row 0"),
    ] {
        let err = segment_starts(bad, 4).expect_err("invalid positions").to_string();
        assert!(err.contains(place), "{err}");
    }
}

/// `affine` (x @ W + b with W in `(in, out)` layout, one node) against candle's matmul and
/// broadcast add: the output and the gradients of all three, for a contiguous weight and a
/// transposed view.
#[test]
fn affine_and_its_gradients_match_candles_ops() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (m, k, n) in [(1, 5, 3), (70, 48, 33), (40, 96, 130)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (m, k), &dev)?)?;
        let w_in_out = Var::from_tensor(&Tensor::randn(0f32, 1.0, (k, n), &dev)?)?;
        let w_out_in = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, k), &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, &dev)?)?;
        let g = Tensor::randn(0f32, 1.0, (m, n), &dev)?;
        for w in [w_in_out.as_tensor().clone(), w_out_in.as_tensor().t()?] {
            let ours = affine(x.as_tensor(), &w, &b, Autocast::Off)?;
            let theirs = x.as_tensor().matmul(&w)?.broadcast_add(&b)?;
            let tol = 1e-5 * (k as f32).sqrt();
            assert!(support::max_abs_diff(&ours, &theirs)? < tol, "({m}, {k}, {n}) forward");
            let grads_ours = (ours * &g)?.sum_all()?.backward()?;
            let grads_theirs = (theirs * &g)?.sum_all()?.backward()?;
            for var in [&x, &w_in_out, &w_out_in, &b] {
                match (grads_ours.get(var.as_tensor()), grads_theirs.get(var.as_tensor())) {
                    (Some(a), Some(c)) => {
                        assert_eq!(a.dims(), c.dims());
                        let d = support::max_abs_diff(a, c)?;
                        assert!(d < 10.0 * tol, "({m}, {k}, {n}): gradient differs by {d}");
                    }
                    (None, None) => {}
                    _ => panic!("({m}, {k}, {n}): a gradient on one side only"),
                }
            }
        }
    }
    Ok(())
}

/// `affine_gelu` is `gelu(affine(..))` in one node: the same values forward and the same
/// gradients of all three inputs, exactly, in f32 and under bf16 autocast.
#[test]
fn affine_gelu_is_the_gelu_of_the_affine() -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let (m, k, n) = (70, 48, 200);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (m, k), dev)?)?;
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.3, (k, n), dev)?)?;
    let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, dev)?)?;
    let g = Tensor::randn(0f32, 1.0, (m, n), dev)?;
    for autocast in [Autocast::Off, Autocast::Bf16] {
        let ours = affine_gelu(x.as_tensor(), w.as_tensor(), b.as_tensor(), autocast)?;
        let theirs = gelu(&affine(x.as_tensor(), w.as_tensor(), b.as_tensor(), autocast)?)?;
        assert_eq!(max_diff(&ours, &theirs), 0.0, "{autocast:?}: forward");
        let ga = (ours * &g)?.sum_all()?.backward()?;
        let gb = (theirs * &g)?.sum_all()?.backward()?;
        for (name, var) in [("x", &x), ("W", &w), ("b", &b)] {
            let (a, c) = (ga.get(var).expect("a gradient"), gb.get(var).expect("a gradient"));
            assert_eq!(a.dims(), c.dims());
            assert_eq!(max_diff(a, c), 0.0, "{autocast:?}: the gradient of {name}");
        }
    }
    Ok(())
}

/// `add_dropout` is `x + dropout(h)` with `dropout`'s masks, forward and backward, exactly.
#[test]
fn add_dropout_is_the_add_of_the_dropout() -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (12, 40), dev)?)?;
    let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (12, 40), dev)?)?;
    let g = Tensor::randn(0f32, 1.0, (12, 40), dev)?;
    let ours = add_dropout(&x, &h, 0.3, 7, 5)?;
    let theirs = (x.as_tensor() + dropout(&h, 0.3, 7, 5)?)?;
    assert_eq!(max_diff(&ours, &theirs), 0.0);
    let ga = (ours * &g)?.sum_all()?.backward()?;
    let gb = (theirs * &g)?.sum_all()?.backward()?;
    for var in [&x, &h] {
        assert_eq!(
            max_diff(ga.get(var).expect("a gradient"), gb.get(var).expect("a gradient")),
            0.0
        );
    }
    Ok(())
}

/// The fused ops' forward and backward passes (element-wise, by rows, the reductions over rows,
/// the operands' packing) spread over the thread pool give the bits they give run on one thread,
/// on inputs of many chunks with a partial last one, f32 and bf16 products. (With one core the
/// pool has no workers and both runs are serial.)
#[test]
fn fused_ops_on_the_pool_give_the_bits_of_one_thread() -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let (rows, c, vocab) = (517, 96, 301);
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, c), dev)?)?;
    let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, c), dev)?)?;
    let gamma = Var::from_tensor(&(Tensor::randn(0f32, 0.1, c, dev)? + 1.0)?)?;
    let beta = Var::from_tensor(&Tensor::randn(0f32, 0.1, c, dev)?)?;
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.2, (c, 3 * c), dev)?)?;
    let b = Var::from_tensor(&Tensor::randn(0f32, 0.1, 3 * c, dev)?)?;
    let head = Var::from_tensor(&Tensor::randn(0f32, 0.2, (vocab, c), dev)?)?;
    let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 37 + 5) % vocab as u32).collect();
    let targets = Tensor::new(ids.as_slice(), dev)?;
    let vars = [&x, &h, &gamma, &beta, &w, &b, &head];
    let run = |autocast: Autocast| -> anyhow::Result<Vec<Vec<f32>>> {
        let y = layer_norm(x.as_tensor(), gamma.as_tensor(), beta.as_tensor(), 1e-5)?;
        let y = add_dropout(&y, &gelu(h.as_tensor())?, 0.1, 7, 3)?;
        let y = affine_gelu(&y, w.as_tensor(), b.as_tensor(), autocast)?;
        let y = dropout(&add_tiled(&y, b.as_tensor())?, 0.2, 9, 0)?;
        let y = linear_product(&y, w.as_tensor(), autocast)?; // (rows, 3c) @ (c, 3c)^T
        let loss = lm_head_loss(&y, head.as_tensor(), &targets, 0.1, true, autocast)?;
        let grads = loss.backward()?;
        let mut out = vec![y.flatten_all()?.to_vec1()?, vec![loss.to_scalar::<f32>()?]];
        for var in vars {
            let g = grads.get(var.as_tensor()).expect("every input has a gradient");
            out.push(g.flatten_all()?.to_vec1()?);
        }
        Ok(out)
    };
    for autocast in [Autocast::Off, Autocast::Bf16] {
        let pooled = run(autocast)?;
        let serial = parallel::serially(|| run(autocast))?;
        assert!(pooled[1][0].is_finite());
        for (i, (p, s)) in pooled.iter().zip(&serial).enumerate() {
            assert!(
                p.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{autocast:?}: output {i} differs between the pool and one thread"
            );
        }
    }
    Ok(())
}

/// The pool's chunks cover every value once, whatever the grain.
#[test]
fn parallel_chunks_cover_every_value_once() {
    for (len, grain) in [(0, 4), (1, 4), (10, 3), (100_003, 1 << 12), (70_000, 70_000)] {
        let mut v = vec![0u32; len];
        parallel::chunks_mut(&mut v, grain, |start, chunk| {
            for (i, x) in chunk.iter_mut().enumerate() {
                *x += (start + i) as u32 + 1;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32 + 1), "{len}/{grain}");
        let collected = parallel::collect(len, grain, |start, out| {
            for (i, x) in out.iter_mut().enumerate() {
                x.write((start + i) as f32);
            }
        });
        assert!(
            collected.iter().enumerate().all(|(i, &x)| x == i as f32),
            "{len}/{grain}"
        );
    }
}

/// A pass compiled for each instruction set this CPU runs gives the bits of the portable one: the
/// GELU gradient's formula (the rational tanh) over values across its range, and a square root
/// and divisions as in AdamW's update.
#[test]
fn vectorised_passes_give_the_same_bits_on_every_instruction_set() {
    let x: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.00731).collect();
    let pass = |simd: Simd| {
        simd::vectorised_on(
            simd,
            #[inline(always)]
            || {
                x.iter()
                    .map(|&x| {
                        let t = fast_tanh(0.797_884_6 * (x + 0.044_715 * x * x * x));
                        let adam = (x / 0.9) / ((x * x / 0.99).sqrt() + 1e-8);
                        (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t)) * adam
                    })
                    .collect::<Vec<f32>>()
            },
        )
    };
    let portable = pass(Simd::Portable);
    for &simd in Simd::available() {
        let got = pass(simd);
        let differ = got
            .iter()
            .zip(&portable)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{simd:?}: {differ} of {} values differ from the portable pass",
            x.len()
        );
    }
}

/// A packed matrix's rows decoded a block at a time equal its values one at a time, and its
/// input gradient `dy W` (W dequantized 256 rows at a time) equals `dy` times its dense copy,
/// in every format, over a row count that leaves a partial chunk and a partial panel.
#[test]
fn packed_rows_and_input_gradient_match_the_dense_copy() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (n, k, m) = (300, 96, 7);
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    let dy = Tensor::randn(0f32, 1.0, (m, n), &dev)?;
    for format in WeightFormat::ALL {
        let packed = PackedMatrix::from_dense(&w, format)?;
        let dense = packed.dense()?;
        assert_eq!(
            max_diff(&packed.dense_rows(17, 250)?, &dense.narrow(0, 17, 250)?),
            0.0,
            "{format}"
        );
        let got = packed.input_gradient(&dy)?;
        let want = dy.matmul(&dense)?;
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{format}: {d}");
        assert!(packed.dense_rows(290, 11).is_err() && packed.input_gradient(&dy.narrow(1, 0, 299)?).is_err());
    }
    Ok(())
}

/// A generation step's fused q/k normalisation and rotation against candle-nn's ops as the model
/// composed them before (narrow and copy each part, `rms_norm` per head, the tables' rows
/// gathered, `rope_thd`, the parts concatenated): the same bits, with and without QK-norm and
/// rotary tables, grouped key/value heads, rows at scattered positions; bad shapes are errors.
#[test]
fn rotate_qkv_is_candles_norm_and_rope_bit_for_bit() {
    use crate::infer::{rotate_qkv, QkNorm, QkvHeads};
    let dev = &Device::Cpu;
    let (n, nh, nkv, hd, max_pos) = (5, 6, 2, 16, 40);
    let heads = QkvHeads {
        n_head: nh,
        n_kv_head: nkv,
        head_dim: hd,
    };
    let (qw, kvw) = (nh * hd, nkv * hd);
    let qkv = Tensor::randn(0f32, 2.0, (n, heads.width()), dev).unwrap();
    let angles = Tensor::randn(0f32, 3.0, (max_pos, hd / 2), dev).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let (gq, gk) = (
        Tensor::randn(1f32, 0.5, hd, dev).unwrap(),
        Tensor::randn(1f32, 0.5, hd, dev).unwrap(),
    );
    let positions: Vec<u32> = vec![0, 7, 39, 3, 3];
    let pos_t = Tensor::new(positions.as_slice(), dev).unwrap();
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (rotate, normed) in [(true, true), (true, false), (false, true)] {
        let q = qkv
            .narrow(1, 0, qw)
            .unwrap()
            .reshape((1, n, nh, hd))
            .unwrap()
            .contiguous()
            .unwrap();
        let k = qkv
            .narrow(1, qw, kvw)
            .unwrap()
            .reshape((1, n, nkv, hd))
            .unwrap()
            .contiguous()
            .unwrap();
        let v = qkv.narrow(1, qw + kvw, kvw).unwrap();
        let (q, k) = match normed {
            true => (
                candle_nn::ops::rms_norm(&q, &gq, 1e-6).unwrap(),
                candle_nn::ops::rms_norm(&k, &gk, 1e-6).unwrap(),
            ),
            false => (q, k),
        };
        let (q, k) = match rotate {
            true => {
                let (c, s) = (
                    cos.index_select(&pos_t, 0).unwrap(),
                    sin.index_select(&pos_t, 0).unwrap(),
                );
                (
                    candle_nn::rotary_emb::rope_thd(&q, &c, &s).unwrap(),
                    candle_nn::rotary_emb::rope_thd(&k, &c, &s).unwrap(),
                )
            }
            false => (q, k),
        };
        let theirs = Tensor::cat(
            &[
                q.reshape((n, qw)).unwrap(),
                k.reshape((n, kvw)).unwrap(),
                v.contiguous().unwrap(),
            ],
            1,
        )
        .unwrap();
        let (cos_v, sin_v, gq_v, gk_v) = (values(&cos), values(&sin), values(&gq), values(&gk));
        let tables = rotate.then_some((cos_v.as_slice(), sin_v.as_slice()));
        let norm = normed.then_some(QkNorm {
            q: &gq_v,
            k: &gk_v,
            eps: 1e-6,
        });
        let ours = rotate_qkv(&values(&qkv), heads, &positions, tables, norm).unwrap();
        let theirs = values(&theirs);
        assert!(
            ours.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits()),
            "rotate {rotate}, norm {normed}: not candle's bits"
        );
    }
    let (cos_v, sin_v) = (values(&cos), values(&sin));
    let tables = Some((cos_v.as_slice(), sin_v.as_slice()));
    let qkv_v = values(&qkv);
    assert!(
        rotate_qkv(&qkv_v, heads, &[0, 1, 40, 2, 3], tables, None).is_err(),
        "position past the tables"
    );
    assert!(
        rotate_qkv(&qkv_v[1..], heads, &positions, tables, None).is_err(),
        "not whole rows"
    );
    assert!(
        rotate_qkv(&qkv_v, heads, &positions[1..], tables, None).is_err(),
        "positions not one per row"
    );
    let short = QkNorm {
        q: &cos_v[..hd - 1],
        k: &cos_v[..hd],
        eps: 1e-6,
    };
    assert!(
        rotate_qkv(&qkv_v, heads, &positions, tables, Some(short)).is_err(),
        "gains of another width"
    );
}

/// The fused residual add and RMSNorm of inference give the bits of the two ops (`x + h`, then
/// [`rms_norm`]), at one row, a few, and enough rows for the pool's threads; within candle-nn's
/// own fused `rms_norm`'s rounding; and nothing off f32.
#[test]
fn add_rms_norm_gives_the_bits_of_the_add_and_the_norm() {
    let dev = &Device::Cpu;
    for (rows, c) in [(1, 576), (3, 64), (700, 96)] {
        let x = Tensor::randn(0f32, 2.0, (rows, c), dev).unwrap();
        let h = Tensor::randn(0f32, 1.0, (rows, c), dev).unwrap();
        let gamma = Tensor::randn(1f32, 0.5, c, dev).unwrap();
        let (s, y) = add_rms_norm(&x, &h, &gamma, 1e-6).unwrap().expect("f32 on the CPU");
        let want_s = (&x + &h).unwrap();
        let want_y = rms_norm(&want_s, &gamma, 1e-6).unwrap();
        assert_eq!((s.dims(), y.dims()), (x.dims(), x.dims()));
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&s), bits(&want_s), "sums at {rows} x {c}");
        assert_eq!(bits(&y), bits(&want_y), "norms at {rows} x {c}");
        let candle = candle_nn::ops::rms_norm(&want_s, &gamma, 1e-6).unwrap();
        assert!(max_diff(&y, &candle) < 1e-5, "{rows} x {c}: {}", max_diff(&y, &candle));
    }
    let x = Tensor::zeros((2, 8), candle_core::DType::BF16, dev).unwrap();
    let gamma = Tensor::ones(8, candle_core::DType::BF16, dev).unwrap();
    assert!(add_rms_norm(&x, &x, &gamma, 1e-6).unwrap().is_none());
}
