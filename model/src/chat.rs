//! Chat templates: a conversation rendered to the text a model reads, by the checkpoint's Jinja
//! template (`chat_template` in `tokenizer_config.json`, rendered with `minijinja` as
//! text-generation-inference and mistral.rs render them), or for a base model without one, a
//! play script. gpt-server renders requests with it, and gpt-train the conversations it
//! fine-tunes on, so that a model is trained on the text it is served.

use std::path::Path;

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// The template for a checkpoint without one (a base model): turns as a play script, each
/// speaker's name in capitals on its own line and a blank line after each turn. A system message
/// is written as it is, before the conversation. Generation stops at [`FALLBACK_STOP`], the blank
/// line that ends the assistant's turn, which is also how a model trained on plays (the default
/// model) ends a speech.
pub const FALLBACK_TEMPLATE: &str = "{% for message in messages %}\
{% if message.role in ['system', 'developer'] %}{{ message.content }}\n\n\
{% else %}{{ message.role | upper }}:\n{{ message.content }}\n\n\
{% endif %}{% endfor %}\
{% if add_generation_prompt %}ASSISTANT:\n{% endif %}";

/// The fallback template's end of turn.
pub const FALLBACK_STOP: &str = "\n\n";

/// One turn of a conversation, as the template sees it (OpenAI's and Hugging Face's fields).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// How a conversation is rendered beyond its messages (vLLM's chat fields).
#[derive(Debug, Default, Clone)]
pub struct RenderOptions {
    /// Default true, or false with `continue_final_message`.
    pub add_generation_prompt: Option<bool>,
    /// End inside the last message, for the model to continue it.
    pub continue_final_message: bool,
    /// The last message's content (what `continue_final_message` continues).
    pub final_content: Option<String>,
    /// Extra template variables.
    pub kwargs: serde_json::Map<String, Value>,
    pub documents: Option<Vec<serde_json::Map<String, Value>>>,
    /// Tools, for templates that describe them to the model.
    pub tools: Option<Vec<Value>>,
}

/// A compiled chat template with the stop strings that end an assistant turn under it.
pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
    pub stop: Vec<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

/// A `tokenizer_config.json`, or `null` where there is none.
fn read_config(path: &Path) -> Result<Value> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map_err(|e| Error::InvalidConfig(format!("{}: not valid JSON: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Value::Null),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// A tokenizer config's `chat_template`: a string, or Hugging Face's list of named templates.
fn template_source(config: &Value) -> Option<String> {
    match &config["chat_template"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

fn invalid(param: &'static str, reason: String) -> Error {
    Error::ChatTemplate { param, reason }
}

impl ChatTemplate {
    /// Compiles `source`; an error names what is wrong with it.
    pub fn new(
        source: String,
        stop: Vec<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        // Python's string and dict methods (`.strip()`, `.items()`), which Hugging Face templates use.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Hugging Face templates reject conversations they cannot render with this function.
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| invalid("chat_template", format!("the chat template does not compile: {e:#}")))?;
        Ok(Self {
            env,
            source,
            stop,
            bos_token,
            eos_token,
        })
    }

    /// The plain template for a base model, with its end-of-turn stop string.
    pub fn fallback() -> Result<Self> {
        Self::new(FALLBACK_TEMPLATE.into(), vec![FALLBACK_STOP.into()], None, None)
    }

    /// The `chat_template` of a checkpoint's `tokenizer_config.json` (a string, or Hugging Face's
    /// list of named templates: `default`), if it has one.
    pub fn source_in(checkpoint: &Path) -> Result<Option<String>> {
        let config_path = checkpoint.join(crate::tokenizer::TOKENIZER_CONFIG_FILE);
        Ok(template_source(&read_config(&config_path)?))
    }

    /// A checkpoint's template: `file` if given, else `chat_template` in the checkpoint's
    /// `tokenizer_config.json` (a string, or Hugging Face's list of named templates: `default`),
    /// with its `bos_token` and `eos_token`; else [`ChatTemplate::fallback`]. An error names the
    /// file.
    ///
    /// A llama.cpp GGUF file's template is its `tokenizer.chat_template`.
    pub fn for_checkpoint(checkpoint: &Path, file: Option<&Path>) -> Result<Self> {
        if crate::llamacpp::is_gguf_file(checkpoint) {
            let (source, bos, eos) = match crate::llamacpp::chat_template(checkpoint)? {
                Some((source, bos, eos)) => (Some(source), bos, eos),
                None => (None, None, None),
            };
            let source = match file {
                Some(file) => Some(std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?),
                None => source,
            };
            return match source {
                Some(source) => Self::new(source, Vec::new(), bos, eos).map_err(|e| match e {
                    Error::ChatTemplate { reason, .. } => {
                        Error::InvalidConfig(format!("{}: {reason}", file.unwrap_or(checkpoint).display()))
                    }
                    other => other,
                }),
                None => Self::fallback(),
            };
        }
        let config_path = checkpoint.join(crate::tokenizer::TOKENIZER_CONFIG_FILE);
        let config = read_config(&config_path)?;
        // A special token is a string, or an object with its `content`.
        let token = |key: &str| {
            let v = &config[key];
            v.as_str().or_else(|| v["content"].as_str()).map(str::to_string)
        };
        let source = match file {
            Some(file) => Some(std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?),
            None => template_source(&config),
        };
        let template = match source {
            Some(source) => Self::new(source, Vec::new(), token("bos_token"), token("eos_token")),
            None => Self::fallback(),
        };
        template.map_err(|e| match e {
            Error::ChatTemplate { reason, .. } => {
                Error::InvalidConfig(format!("{}: {reason}", file.unwrap_or(&config_path).display()))
            }
            other => other,
        })
    }

    /// The prompt for `messages`, ending where the assistant's next turn begins.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        self.render_with(messages, &RenderOptions::default())
    }

    /// This template's special tokens and stop strings with another source (a request's own
    /// `chat_template`); an error names what is wrong with it.
    pub fn with_source(&self, source: &str) -> Result<Self> {
        if source.is_empty() {
            return Err(invalid("chat_template", "chat_template must not be empty".into()));
        }
        Self::new(
            source.to_string(),
            self.stop.clone(),
            self.bos_token.clone(),
            self.eos_token.clone(),
        )
    }

    /// The text for `messages` as `options` ask: with or without the start of the assistant's
    /// turn, or ending inside the last message (for the model to continue it), with extra
    /// template variables. An error names the parameter at fault (`messages`,
    /// `continue_final_message`).
    pub fn render_with(&self, messages: &[Message], options: &RenderOptions) -> Result<String> {
        if messages.is_empty() {
            return Err(invalid("messages", "messages must hold at least one message".into()));
        }
        let continue_final = options.continue_final_message;
        if continue_final && options.add_generation_prompt == Some(true) {
            return Err(invalid(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true".into(),
            ));
        }
        let add_generation_prompt = options.add_generation_prompt.unwrap_or(!continue_final);
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| invalid("chat_template", e.to_string()))?;
        let extra = minijinja::Value::from_serialize(&options.kwargs);
        let rendered = template
            .render(context! {
                messages,
                add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                documents => options.documents,
                tools => options.tools,
                ..extra
            })
            .map_err(|e| {
                let detail = e.detail().map_or_else(|| e.to_string(), str::to_string);
                invalid(
                    "messages",
                    format!("the chat template cannot render these messages: {detail}"),
                )
            })?;
        if !continue_final {
            return Ok(rendered);
        }
        // Cut after the last message's content, as vLLM does: what the template writes after
        // it (an end of turn) would close the message the model is to continue.
        // (A template that does not write the content out, or an empty content, leaves the
        // rendering as it is.)
        let last = options.final_content.as_deref().unwrap_or_default();
        match rendered.rfind(last) {
            Some(at) if !last.is_empty() => Ok(rendered[..at + last.len()].to_string()),
            _ => Ok(rendered),
        }
    }
}

impl ChatTemplate {
    /// A conversation as training text: the whole conversation rendered (no generation prompt)
    /// and cut into pieces, each `true` where it is an assistant turn (its content and what the
    /// template writes to end it, which the model learns to write too). The text before an
    /// assistant turn is what [`ChatTemplate::render`] gives for the messages before it, the
    /// prompt gpt-server generates that turn from. Refused, naming the message, where the
    /// template's renderings of a conversation's beginnings do not extend one another, or where
    /// the conversation opens with an assistant turn (no prompt to answer).
    pub fn training_pieces(&self, messages: &[Message]) -> Result<Vec<(String, bool)>> {
        let whole = self.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt: Some(false),
                ..RenderOptions::default()
            },
        )?;
        let mut pieces = Vec::new();
        let mut at = 0;
        for (i, message) in messages.iter().enumerate() {
            if message.role != "assistant" {
                continue;
            }
            if i == 0 {
                return Err(invalid(
                    "messages",
                    "message 0 is the assistant's: a conversation to train on opens with a prompt".into(),
                ));
            }
            let prompt = self.render(&messages[..i])?;
            let through = self.render_with(
                &messages[..=i],
                &RenderOptions {
                    add_generation_prompt: Some(false),
                    ..RenderOptions::default()
                },
            )?;
            if !(whole.starts_with(&through) && through.starts_with(&prompt) && prompt.len() >= at) {
                return Err(invalid(
                    "messages",
                    format!(
                        "the chat template renders message {i} (the assistant's) so that the conversation \
                         before it is not the prompt it answers: it cannot be trained on turn by turn"
                    ),
                ));
            }
            pieces.push((whole[at..prompt.len()].to_string(), false));
            pieces.push((through[prompt.len()..].to_string(), true));
            at = through.len();
        }
        if at < whole.len() {
            pieces.push((whole[at..].to_string(), false));
        }
        pieces.retain(|(text, _)| !text.is_empty());
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_template_writes_a_play_script() -> Result<()> {
        let t = ChatTemplate::fallback()?;
        let prompt = t.render(&[
            Message::new("system", "A scene in Verona."),
            Message::new("user", "Who goes there?"),
            Message::new("assistant", "A friend."),
            Message::new("user", "Speak, friend."),
        ])?;
        assert_eq!(
            prompt,
            "A scene in Verona.\n\nUSER:\nWho goes there?\n\nASSISTANT:\nA friend.\n\nUSER:\nSpeak, friend.\n\nASSISTANT:\n"
        );
        assert_eq!(t.stop, vec!["\n\n".to_string()]);
        Ok(())
    }

    #[test]
    fn hugging_face_templates_render_with_python_methods_and_can_refuse() -> Result<()> {
        // The shape of many Hub templates: Python string methods, raise_exception, eos_token.
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}\
            {% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}{{ eos_token }}{% endfor %}\
            {% if add_generation_prompt %}<|assistant|>{% endif %}";
        let t = ChatTemplate::new(source.into(), vec![], None, Some("</s>".into()))?;
        assert_eq!(
            t.render(&[Message::new("user", "  hi  ")])?,
            "<|user|>hi</s><|assistant|>"
        );
        let err = t
            .render(&[Message::new("assistant", "x")])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("first message must be from the user"), "{err}");
        assert!(t.render(&[]).is_err());
        let bad = ChatTemplate::new("{% for %}".into(), vec![], None, None);
        assert!(bad.err().is_some_and(|e| e.to_string().contains("does not compile")));
        Ok(())
    }

    #[test]
    fn a_conversation_trains_on_the_assistant_turns_after_the_prompts_the_server_renders() -> Result<()> {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
            {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let conversation = [
            Message::new("system", "A scene in Verona."),
            Message::new("user", "Who goes there?"),
            Message::new("assistant", "A friend."),
            Message::new("user", "Speak, friend."),
            Message::new("assistant", "Enter."),
        ];
        for t in [
            ChatTemplate::fallback()?,
            ChatTemplate::new(chatml.into(), vec![], None, None)?,
        ] {
            let pieces = t.training_pieces(&conversation)?;
            let whole: String = pieces.iter().map(|(p, _)| p.as_str()).collect();
            let rendered = t.render_with(
                &conversation,
                &RenderOptions {
                    add_generation_prompt: Some(false),
                    ..RenderOptions::default()
                },
            )?;
            assert_eq!(whole, rendered);
            let trained: Vec<&str> = pieces.iter().filter(|(_, a)| *a).map(|(p, _)| p.as_str()).collect();
            assert_eq!(trained.len(), 2, "{pieces:?}");
            assert!(
                trained[0].starts_with("A friend.") && trained[1].starts_with("Enter."),
                "{trained:?}"
            );
            // Before each assistant turn: exactly the prompt the server renders for it.
            let mut turns = [2, 4].into_iter();
            let mut before = String::new();
            for (text, assistant) in &pieces {
                if *assistant {
                    let turn = turns.next().unwrap_or(conversation.len());
                    assert_eq!(before, t.render(&conversation[..turn])?);
                }
                before.push_str(text);
            }
        }
        assert_eq!(
            ChatTemplate::fallback()?.training_pieces(&conversation)?[1],
            ("A friend.\n\n".to_string(), true),
            "the turn's end is learnt with it"
        );
        let err = ChatTemplate::fallback()?
            .training_pieces(&[Message::new("assistant", "x")])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("message 0"), "{err}");
        Ok(())
    }
}
