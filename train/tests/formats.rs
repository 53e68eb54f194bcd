//! Data in the ecosystem's formats, through `gpt-train` as a user runs it: the same documents as
//! text files, JSON lines and parquet (written by pyarrow) train to bit-identical losses; a Hub
//! dataset the same as its parquet file; an llm.c shard (written as llm.c's `write_datafile`
//! does) evaluates to the perplexity of its text; `gpt-train prepare`'s files read back with
//! NumPy in llm.c's and nanoGPT's layouts and train here; a model and a tokenizer by Hub id; and
//! each bad input is an error naming the file and the place. Fixtures:
//! `tests/fixtures/make_data_fixtures.py`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use gpt_test_support as support;
use gpt_test_support::fake_hub;

use common::{stderr, BIN};

fn docs() -> PathBuf {
    support::repo("tests/fixtures/docs")
}

fn gpt_train(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Output> {
    let mut command = Command::new(BIN);
    command.args(args).env("RUST_LOG", "warn").env_remove("HF_HUB_OFFLINE");
    for (k, v) in env {
        command.env(k, v);
    }
    Ok(command.output()?)
}

/// Six steps of a tiny model on `data` (with a character vocabulary), its training losses.
fn train_losses(data: &[&str], out: &Path, env: &[(&str, &str)]) -> anyhow::Result<Vec<f64>> {
    let settings = [
        "--batch-size",
        "4",
        "--max-iters",
        "6",
        "--eval-interval",
        "3",
        "--threads",
        "1",
    ];
    let args = common::train_args_on(data, out, &settings);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = gpt_train(&args, env)?;
    anyhow::ensure!(result.status.success(), "{}", stderr(&result));
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut losses = Vec::new();
    for line in text.lines() {
        let e: serde_json::Value = serde_json::from_str(line)?;
        if e["event"] == "train" {
            losses.push(e["train_loss"].as_f64().unwrap_or(f64::NAN));
        }
    }
    Ok(losses)
}

#[test]
fn the_same_documents_as_text_json_lines_and_parquet_train_to_identical_losses() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let txt = docs().join("txt");
    let as_text = train_losses(&[txt.to_str().unwrap_or_default()], &tmp.path().join("txt"), &[])?;
    assert_eq!(as_text.len(), 6);
    for file in ["docs.jsonl", "docs.parquet"] {
        let path = docs().join(file);
        let losses = train_losses(&[path.to_str().unwrap_or_default()], &tmp.path().join(file), &[])?;
        assert_eq!(losses, as_text, "{file}");
    }
    // Another column, named.
    let path = docs().join("docs_content.parquet");
    let out = tmp.path().join("content");
    let losses = train_losses(
        &[path.to_str().unwrap_or_default(), "--text-field", "content"],
        &out,
        &[],
    )?;
    assert_eq!(losses, as_text, "docs_content.parquet --text-field content");
    Ok(())
}

/// The parquet fixture as a Hub dataset (`data/train-00000-of-00001.parquet`, as the Hub's
/// parquet conversion names files) with a README beside it.
fn dataset_repo() -> anyhow::Result<fake_hub::FakeRepo> {
    let mut repo = fake_hub::FakeRepo::model("org/docs", vec![]);
    repo.dataset = true;
    repo.files = vec![
        ("README.md".into(), b"# docs".to_vec()),
        (
            "data/train-00000-of-00001.parquet".into(),
            std::fs::read(docs().join("docs.parquet"))?,
        ),
    ];
    Ok(repo)
}

#[test]
fn a_hub_dataset_trains_as_its_parquet_file_and_is_then_found_offline() -> anyhow::Result<()> {
    let hub = fake_hub::FakeHub::start(vec![dataset_repo()?]);
    let tmp = tempfile::tempdir()?;
    let cache = tmp.path().join("hub");
    let cache = cache.to_str().unwrap_or_default();
    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HUB_CACHE", cache)];
    let local = docs().join("docs.parquet");
    let want = train_losses(&[local.to_str().unwrap_or_default()], &tmp.path().join("local"), &[])?;
    let got = train_losses(&["hf://datasets/org/docs"], &tmp.path().join("hub-run"), &env)?;
    assert_eq!(got, want);
    let offline = [("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")];
    let before = hub.requests();
    let again = train_losses(&["hf://datasets/org/docs/data"], &tmp.path().join("offline"), &offline)?;
    assert_eq!(again, want);
    assert_eq!(hub.requests(), before, "offline, yet the Hub was asked");
    let out = gpt_train(
        &[
            "train",
            "--data",
            "hf://datasets/org/docs/nothing-here",
            "--out",
            tmp.path().join("x").to_str().unwrap_or_default(),
        ],
        &env,
    )?;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("nothing-here"), "{}", stderr(&out));
    Ok(())
}

/// `gpt-train eval --json` of the tiny fixture model on `data` (and extra flags).
fn eval(checkpoint: &str, data: &Path, extra: &[&str], env: &[(&str, &str)]) -> anyhow::Result<serde_json::Value> {
    let mut args = vec![
        "eval",
        "--checkpoint",
        checkpoint,
        "--data",
        data.to_str().unwrap_or_default(),
        "--json",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    let out = gpt_train(&args, env)?;
    anyhow::ensure!(out.status.success(), "{}", stderr(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[test]
fn an_llmc_shard_evaluates_to_the_perplexity_of_its_text() -> anyhow::Result<()> {
    let model = support::repo("tests/fixtures/tiny-gpt2");
    let model = model.to_str().unwrap_or_default();
    let text = eval(model, &support::repo("tests/fixtures/tiny-gpt2/eval.txt"), &[], &[])?;
    let shard = docs().join("tiny_val_000000.bin");
    for extra in [&[][..], &["--data-format", "llmc"][..]] {
        let tokens = eval(model, &shard, extra, &[])?;
        for key in ["tokens_scored", "mean_nll", "perplexity", "bits_per_byte"] {
            assert_eq!(tokens[key], text[key], "{key} ({extra:?})");
        }
    }
    Ok(())
}

/// A corpus with its character tokenizer, its ids and the validation split's length, in `tmp`.
struct Corpus {
    text: PathBuf,
    tok: gpt::Tokenizer,
    ids: Vec<u32>,
    n_val: usize,
}

fn corpus(tmp: &Path) -> anyhow::Result<Corpus> {
    let corpus = support::shakespeare(20_000)?;
    let text = tmp.join("corpus.txt");
    std::fs::write(&text, &corpus)?;
    let tok = gpt::Tokenizer::train_char(std::slice::from_ref(&text))?;
    let ids = tok.encode(&corpus)?;
    let n_val = (ids.len() as f64 * 0.1).round() as usize;
    Ok(Corpus { text, tok, ids, n_val })
}

/// `gpt-train prepare --format format` on the corpus: the output directory and its train and
/// val files.
fn prepare(tmp: &Path, c: &Corpus, format: &str) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    let text = &c.text;
    let out = tmp.join(format);
    let result = gpt_train(
        &[
            "prepare",
            "--format",
            format,
            "--tokenizer",
            "char",
            "--data",
            text.to_str().unwrap_or_default(),
            "--out",
            out.to_str().unwrap_or_default(),
        ],
        &[],
    )?;
    assert!(result.status.success(), "{}", stderr(&result));
    let (train, val) = match format {
        "llmc" => (out.join("train_000000.bin"), out.join("val_000000.bin")),
        _ => (out.join("train.bin"), out.join("val.bin")),
    };
    Ok((out, train, val))
}

#[test]
#[cfg_attr(not(gpt_test_numpy), ignore = "needs GPT_TEST_PYTHON, a Python with NumPy")]
fn prepared_token_files_read_back_with_numpy() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let c = corpus(tmp.path())?;
    let (tok, ids, n_val) = (&c.tok, &c.ids, c.n_val);
    for format in ["llmc", "nanogpt"] {
        let (out, train, val) = prepare(tmp.path(), &c, format)?;
        // What NumPy reads, in llm.c's layout (header, uint16) or nanoGPT's (uint16 only).
        let script = r#"
import sys, json, pickle, numpy as np
fmt, train, val, meta = sys.argv[1:5]
def read(path):
    if fmt == "llmc":
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
            assert header[0] == 20240520 and header[1] == 1, header[:3]
            toks = np.frombuffer(f.read(), dtype=np.uint16)
            assert len(toks) == header[2], (len(toks), header[2])
            return toks
    return np.fromfile(path, dtype=np.uint16)
out = {"train": read(train).tolist(), "val": read(val).tolist()}
if fmt == "nanogpt":
    with open(meta, "rb") as f:
        m = pickle.load(f)
    assert m["vocab_size"] == len(m["itos"]) == len(m["stoi"])
    assert all(m["stoi"][c] == i for i, c in m["itos"].items())
    out["vocab_size"] = m["vocab_size"]
print(json.dumps(out))
"#;
        let read = Command::new(support::python())
            .args(["-c", script, format])
            .args([&train, &val, &out.join("meta.pkl")])
            .output()?;
        assert!(
            read.status.success(),
            "{format}: {}",
            String::from_utf8_lossy(&read.stderr)
        );
        let read: serde_json::Value = serde_json::from_slice(&read.stdout)?;
        let as_ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
                .unwrap_or_default()
        };
        assert_eq!(
            as_ids(&read["train"]),
            ids[..ids.len() - n_val].to_vec(),
            "{format} train"
        );
        assert_eq!(as_ids(&read["val"]), ids[ids.len() - n_val..].to_vec(), "{format} val");
        if format == "nanogpt" {
            assert_eq!(read["vocab_size"], tok.vocab_size());
        }
    }
    Ok(())
}

#[test]
fn prepared_token_files_train_here_as_their_text_does() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let c = corpus(tmp.path())?;
    let text = &c.text;
    for format in ["llmc", "nanogpt"] {
        let (out, train, val) = prepare(tmp.path(), &c, format)?;
        // And they train here, with the tokenizer written beside them, as the text does.
        let run = tmp.path().join(format!("{format}-run"));
        let tokenizer = out.join("tokenizer.json");
        let losses = train_losses(
            &[
                train.to_str().unwrap_or_default(),
                "--val-data",
                val.to_str().unwrap_or_default(),
                "--tokenizer",
                tokenizer.to_str().unwrap_or_default(),
            ],
            &run,
            &[],
        )?;
        let from_text = train_losses(
            &[text.to_str().unwrap_or_default()],
            &tmp.path().join(format!("{format}-text")),
            &[],
        )?;
        assert_eq!(losses, from_text, "{format}: token files and their text");
    }
    Ok(())
}

#[test]
fn bad_data_is_an_error_naming_the_file_and_place() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("out");
    let out = out.to_str().unwrap_or_default();
    let fail = |data: &Path, extra: &[&str]| -> anyhow::Result<String> {
        let mut args = vec![
            "train",
            "--data",
            data.to_str().unwrap_or_default(),
            "--out",
            out,
            "--max-iters",
            "1",
        ];
        args.extend_from_slice(extra);
        let result = gpt_train(&args, &[])?;
        anyhow::ensure!(!result.status.success(), "{} was accepted", data.display());
        Ok(stderr(&result))
    };
    let write = |name: &str, bytes: &[u8]| -> anyhow::Result<PathBuf> {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes)?;
        Ok(path)
    };
    let jsonl = write("bad.jsonl", b"{\"text\": \"a\"}\n\n{\"text\": \"b\"\n")?;
    let err = fail(&jsonl, &[])?;
    assert!(err.contains("bad.jsonl:3") && err.contains("invalid JSON"), "{err}");
    let jsonl = write("field.jsonl", b"{\"body\": \"a\"}\n")?;
    let err = fail(&jsonl, &[])?;
    assert!(
        err.contains("field.jsonl:1") && err.contains("`text`") && err.contains("body"),
        "{err}"
    );
    let jsonl = write("number.jsonl", b"{\"text\": \"a\"}\n{\"text\": 7}\n")?;
    let err = fail(&jsonl, &[])?;
    assert!(err.contains("number.jsonl:2") && err.contains("number"), "{err}");
    let err = fail(&docs().join("docs_content.parquet"), &[])?;
    assert!(
        err.contains("docs_content.parquet") && err.contains("content") && err.contains("`text`"),
        "{err}"
    );
    let parquet = write("corrupt.parquet", b"PAR1 this is not a parquet file at all")?;
    let err = fail(&parquet, &[])?;
    assert!(err.contains("corrupt.parquet") && err.contains("parquet"), "{err}");
    let mut truncated = std::fs::read(docs().join("docs.parquet"))?;
    truncated.truncate(truncated.len() / 2);
    let parquet = write("truncated.parquet", &truncated)?;
    let err = fail(&parquet, &[])?;
    assert!(err.contains("truncated.parquet"), "{err}");

    // Token files: a wrong magic, a count that disagrees with the size, an odd byte count, an id
    // outside the vocabulary (named with its position).
    let tokenizer = support::repo("tests/fixtures/tiny-gpt2/tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap_or_default();
    let mut shard = std::fs::read(docs().join("tiny_val_000000.bin"))?;
    let mut wrong = shard.clone();
    wrong[0] ^= 1;
    let err = fail(
        &write("magic.bin", &wrong)?,
        &["--data-format", "llmc", "--tokenizer", tokenizer],
    )?;
    assert!(err.contains("magic.bin") && err.contains("magic"), "{err}");
    shard.extend_from_slice(&[1, 0]);
    let err = fail(&write("count.bin", &shard)?, &["--tokenizer", tokenizer])?;
    assert!(err.contains("count.bin") && err.contains("bytes"), "{err}");
    let err = fail(&write("odd.bin", &[1, 0, 2])?, &["--tokenizer", tokenizer])?;
    assert!(err.contains("odd.bin") && err.contains("odd"), "{err}");
    let mut ids: Vec<u8> = (0u16..40).flat_map(|i| i.to_le_bytes()).collect();
    ids.extend_from_slice(&5000u16.to_le_bytes());
    let err = fail(&write("vocab.bin", &ids)?, &["--tokenizer", tokenizer])?;
    assert!(
        err.contains("vocab.bin") && err.contains("5000") && err.contains("position 40"),
        "{err}"
    );
    // A token file cannot train a tokenizer.
    let err = fail(&docs().join("tiny_val_000000.bin"), &[])?;
    assert!(
        err.contains("tiny_val_000000.bin") && err.contains("--tokenizer"),
        "{err}"
    );
    Ok(())
}

#[test]
fn models_and_tokenizers_by_hub_id_in_every_command() -> anyhow::Result<()> {
    let dir = support::repo("tests/fixtures/tiny-gpt2");
    let mut repo = fake_hub::FakeRepo::from_dir("org/tiny-gpt2", &dir)?;
    repo.files
        .retain(|(f, _)| ["config.json", "model.safetensors", "tokenizer.json"].contains(&f.as_str()));
    let hub = fake_hub::FakeHub::start(vec![repo]);
    let tmp = tempfile::tempdir()?;
    let cache = tmp.path().join("hub");
    let env = [
        ("HF_ENDPOINT", hub.url.as_str()),
        ("HF_HUB_CACHE", cache.to_str().unwrap_or_default()),
    ];
    let text = support::repo("tests/fixtures/tiny-gpt2/eval.txt");
    let want = eval(dir.to_str().unwrap_or_default(), &text, &[], &[])?;
    let got = eval("org/tiny-gpt2", &text, &[], &env)?;
    assert_eq!(got, want, "eval --checkpoint org/tiny-gpt2");
    // Fine-tuning from the Hub id, and a tokenizer by Hub id.
    let out = tmp.path().join("ft");
    let result = gpt_train(
        &[
            "train",
            "--init-from",
            "org/tiny-gpt2",
            "--data",
            text.to_str().unwrap_or_default(),
            "--val-data",
            text.to_str().unwrap_or_default(),
            "--out",
            out.to_str().unwrap_or_default(),
            "--max-iters",
            "2",
            "--eval-iters",
            "1",
            "--batch-size",
            "2",
            "--device",
            "cpu",
        ],
        &env,
    )?;
    assert!(result.status.success(), "{}", stderr(&result));
    let prepared = tmp.path().join("prep");
    let result = gpt_train(
        &[
            "prepare",
            "--format",
            "llmc",
            "--tokenizer",
            "org/tiny-gpt2",
            "--data",
            text.to_str().unwrap_or_default(),
            "--out",
            prepared.to_str().unwrap_or_default(),
            "--val-fraction",
            "0",
        ],
        &env,
    )?;
    assert!(result.status.success(), "{}", stderr(&result));
    // The prepared shard of eval.txt under the model's tokenizer is the fixture shard's tokens.
    let ours = std::fs::read(prepared.join("train_000000.bin"))?;
    assert_eq!(ours, std::fs::read(docs().join("tiny_val_000000.bin"))?);
    Ok(())
}
