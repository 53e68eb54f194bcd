//! `POST /v1/chat/completions`: the messages are rendered to one prompt by the checkpoint's chat
//! template (Jinja, with `minijinja` as text-generation-inference and mistral.rs render them),
//! the request becomes a completion request, and the completions engine and fold do the rest;
//! this module shapes their output as chat responses and chunks.

use minijinja::{context, Environment, ErrorKind};

use crate::api::*;
use crate::error::ApiError;
use crate::fold::Delta;
use crate::tools::{self, Mode, StreamedChoice};

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

/// A compiled chat template with the stop strings that end an assistant turn under it.
pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
    pub stop: Vec<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; an error names what is wrong with it (at start-up, not per request).
    pub fn new(
        source: String,
        stop: Vec<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> anyhow::Result<Self> {
        let mut env = Environment::new();
        // Python's string and dict methods (`.strip()`, `.items()`), which Hugging Face templates use.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Hugging Face templates reject conversations they cannot render with this function.
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| anyhow::anyhow!("the chat template does not compile: {e:#}"))?;
        Ok(Self {
            env,
            source,
            stop,
            bos_token,
            eos_token,
        })
    }

    /// The plain template for a base model, with its end-of-turn stop string.
    pub fn fallback() -> anyhow::Result<Self> {
        Self::new(FALLBACK_TEMPLATE.into(), vec![FALLBACK_STOP.into()], None, None)
    }

    /// The prompt for `messages`, ending where the assistant's next turn begins.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ApiError> {
        self.render_with(messages, &RenderOptions::default())
    }

    /// This template's special tokens and stop strings with another source (a request's own
    /// `chat_template`); an error names what is wrong with it.
    pub fn with_source(&self, source: &str) -> Result<Self, ApiError> {
        if source.is_empty() {
            return Err(ApiError::invalid("chat_template", "chat_template must not be empty"));
        }
        Self::new(
            source.to_string(),
            self.stop.clone(),
            self.bos_token.clone(),
            self.eos_token.clone(),
        )
        .map_err(|e| ApiError::invalid("chat_template", format!("{e:#}")))
    }

    /// The prompt for `messages` as `options` ask: with or without the start of the
    /// assistant's turn, or ending inside the last message (for the model to continue it), with
    /// the request's extra template variables.
    pub fn render_with(&self, messages: &[ChatMessage], options: &RenderOptions) -> Result<String, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must hold at least one message"));
        }
        let continue_final = options.continue_final_message;
        if continue_final && options.add_generation_prompt == Some(true) {
            return Err(ApiError::invalid(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true",
            ));
        }
        let add_generation_prompt = options.add_generation_prompt.unwrap_or(!continue_final);
        let messages: Vec<_> = messages
            .iter()
            .map(|m| {
                context! { role => m.role, content => m.content.0, name => m.name,
                tool_calls => m.tool_calls, tool_call_id => m.tool_call_id }
            })
            .collect();
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::Internal(e.to_string()))?;
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
                ApiError::invalid(
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

/// How a request asks for its conversation to be rendered (vLLM's chat fields).
#[derive(Debug, Default)]
pub struct RenderOptions {
    /// Default true, or false with `continue_final_message`.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: bool,
    /// The last message's content (what `continue_final_message` continues).
    pub final_content: Option<String>,
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    pub documents: Option<Vec<serde_json::Map<String, serde_json::Value>>>,
    /// The request's `tools`, for templates that describe them to the model.
    pub tools: Option<Vec<serde_json::Value>>,
}

impl RenderOptions {
    /// The options a chat request gives (its fields are taken out of it).
    pub fn take(req: &mut ChatCompletionRequest) -> Self {
        let continue_final_message = req.continue_final_message.unwrap_or(false);
        Self {
            add_generation_prompt: req.add_generation_prompt,
            continue_final_message,
            final_content: (req.messages.last())
                .filter(|_| continue_final_message)
                .map(|m| m.content.0.clone()),
            kwargs: req.chat_template_kwargs.take().unwrap_or_default(),
            documents: req.documents.take(),
            tools: req.tools.clone(),
        }
    }
}

/// With `echo`: the content of the last message when it is the assistant's, which the answer
/// continues (vLLM's chat `echo`).
pub fn echoed(req: &ChatCompletionRequest) -> Option<String> {
    let last = req.messages.last()?;
    (req.echo == Some(true) && last.role == Role::Assistant).then(|| last.content.0.clone())
}

/// The completion request that generates the assistant's turn for `req`, whose messages the
/// template rendered to `prompt`. `max_tokens_cap` is the default length (generation also ends at
/// the context). Its own parameters were validated first ([`crate::validation::validate_chat`]).
pub fn completion_request(
    mut req: ChatCompletionRequest,
    prompt: String,
    template_stop: &[String],
    max_tokens_cap: usize,
) -> Result<CompletionRequest, ApiError> {
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs requires logprobs: true",
            ))
        }
        (false, None) => None,
    };
    let mut stop = match req.stop.take() {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    for s in template_stop {
        if !stop.contains(s) {
            stop.push(s.clone());
        }
    }
    let max_tokens = req
        .max_completion_tokens
        .or(req.max_tokens)
        .or(Some(max_tokens_cap as i64));
    let mut completion = req.completion(Prompt::Text(prompt), max_tokens, logprobs);
    completion.stop = (!stop.is_empty()).then_some(Stop::Many(stop));
    Ok(completion)
}

/// Names a completions error by the chat request's parameters: `max_completion_tokens` (when it
/// was the one given) for `max_tokens`, `top_logprobs` for `logprobs`, `messages` for `prompt`.
pub fn chat_error(e: ApiError, used_max_completion_tokens: bool) -> ApiError {
    fn rename(param: &str, used_max_completion_tokens: bool) -> &str {
        match param {
            "max_tokens" if used_max_completion_tokens => "max_completion_tokens",
            "logprobs" => "top_logprobs",
            "prompt" => "messages",
            other => other,
        }
    }
    match e {
        ApiError::InvalidRequest {
            message,
            param: Some(param),
        } => {
            let new = rename(&param, used_max_completion_tokens);
            let message = match message.strip_prefix(param.as_str()) {
                Some(rest) => format!("{new}{rest}"),
                None => message,
            };
            let message = match new {
                "messages" => format!("the prompt rendered from messages: {message}"),
                _ => message,
            };
            ApiError::InvalidRequest {
                message,
                param: Some(new.to_string()),
            }
        }
        ApiError::ContextLength { message, .. } => ApiError::ContextLength {
            message: match message.strip_prefix("prompt") {
                Some(rest) => format!("the prompt rendered from messages{rest}"),
                None => message,
            },
            param: "messages",
        },
        other => other,
    }
}

/// A completion's logprobs in chat's shape.
pub fn chat_logprobs(lp: LogProbs) -> ChatLogProbs {
    let content = lp
        .tokens
        .into_iter()
        .zip(lp.token_logprobs)
        .zip(lp.top_logprobs)
        .map(|((token, logprob), top)| ChatTokenLogprob {
            bytes: token.as_bytes().to_vec(),
            // Generated tokens always have one; OpenAI writes -9999 for an impossible token.
            logprob: logprob.unwrap_or(-9999.0),
            top_logprobs: top
                .into_iter()
                .flatten()
                .map(|(token, p)| TopLogprob {
                    bytes: token.as_bytes().to_vec(),
                    logprob: p.as_f64().unwrap_or(-9999.0) as f32,
                    token,
                })
                .collect(),
            token,
        })
        .collect();
    ChatLogProbs { content }
}

/// A whole completion's choice as a chat choice.
pub fn chat_choice(choice: Choice, echo: Option<&str>, tools: Option<&Mode>) -> ChatChoice {
    let text = format!("{}{}", echo.unwrap_or_default(), choice.text);
    // Under tools, a complete output that is calls becomes them.
    let calls = (tools.zip(choice.finish_reason.as_deref()))
        .filter(|&(_, reason)| reason == "stop")
        .and_then(|(mode, _)| tools::parse(mode, &choice.text));
    let (content, tool_calls, finish_reason) = match calls {
        Some(calls) => (None, calls, Some("tool_calls".to_string())),
        None => (Some(text), Vec::new(), choice.finish_reason),
    };
    ChatChoice {
        index: choice.index,
        message: ChatResponseMessage {
            role: "assistant".into(),
            content,
            tool_calls,
        },
        logprobs: choice.logprobs.map(chat_logprobs),
        finish_reason,
        stop_reason: choice.stop_reason,
    }
}

/// The chunks of one delta: its content (if any), then its finish reason in a chunk of its own,
/// as OpenAI sends them. Under tools (`tools`: the mode and the choice's stream so far), content
/// becomes tool-call deltas as [`StreamedChoice`] decides, and a turn of calls finishes with
/// "tool_calls".
pub fn chat_chunks(delta: Delta, tools: Option<(&Mode, &mut StreamedChoice)>) -> Vec<ChatChunkChoice> {
    let mut out = Vec::new();
    let complete = delta.finish_reason.map(|r| r == crate::engine::FinishReason::Stop);
    let named = matches!(tools, Some((Mode::Named(_), _)));
    let under_tools = tools.is_some();
    let (content, calls) = match tools {
        None => (Some(delta.text), None),
        Some((mode, stream)) => {
            let o = stream.push(mode, &delta.text, complete);
            (o.content, o.calls)
        }
    };
    let called = calls.is_some();
    let has_logprobs = delta.logprobs.as_ref().is_some_and(|l| !l.tokens.is_empty());
    if content.as_ref().is_some_and(|c| !c.is_empty()) || called || has_logprobs {
        out.push(ChatChunkChoice {
            index: delta.index,
            delta: ChatDelta {
                role: None,
                content: content.filter(|c| !c.is_empty() || !called),
                tool_calls: calls,
            },
            logprobs: delta.logprobs.map(chat_logprobs),
            finish_reason: None,
            stop_reason: None,
        });
    }
    if let Some(reason) = delta.finish_reason {
        // A named function's turn is its call; `required` and `auto` ones are calls where the
        // whole output read as calls (sent with this delta).
        let calls_made =
            complete == Some(true) && (named || under_tools && out.iter().any(|c| c.delta.tool_calls.is_some()));
        out.push(ChatChunkChoice {
            index: delta.index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(if calls_made { "tool_calls" } else { reason.as_str() }.into()),
            stop_reason: delta.stop_reason.as_ref().map(crate::engine::StopReason::to_json),
        });
    }
    out
}

/// The first chunk of a choice: its role, and empty content (or the echoed last message).
pub fn role_chunk(index: u32, echo: Option<&str>) -> ChatChunkChoice {
    ChatChunkChoice {
        index,
        delta: ChatDelta {
            role: Some("assistant".into()),
            content: Some(echo.unwrap_or_default().to_string()),
            tool_calls: None,
        },
        logprobs: None,
        finish_reason: None,
        stop_reason: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: Role, content: &str) -> ChatMessage {
        ChatMessage {
            role,
            content: Content(content.into()),
            name: None,
            refusal: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    #[test]
    fn the_fallback_template_writes_a_play_script() -> anyhow::Result<()> {
        let t = ChatTemplate::fallback()?;
        let prompt = t.render(&[
            msg(Role::System, "A scene in Verona."),
            msg(Role::User, "Who goes there?"),
            msg(Role::Assistant, "A friend."),
            msg(Role::User, "Speak, friend."),
        ])?;
        assert_eq!(
            prompt,
            "A scene in Verona.\n\nUSER:\nWho goes there?\n\nASSISTANT:\nA friend.\n\nUSER:\nSpeak, friend.\n\nASSISTANT:\n"
        );
        assert_eq!(t.stop, vec!["\n\n".to_string()]);
        Ok(())
    }

    #[test]
    fn hugging_face_templates_render_with_python_methods_and_can_refuse() -> anyhow::Result<()> {
        // The shape of many Hub templates: Python string methods, raise_exception, eos_token.
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}\
            {% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}{{ eos_token }}{% endfor %}\
            {% if add_generation_prompt %}<|assistant|>{% endif %}";
        let t = ChatTemplate::new(source.into(), vec![], None, Some("</s>".into()))?;
        assert_eq!(t.render(&[msg(Role::User, "  hi  ")])?, "<|user|>hi</s><|assistant|>");
        let err = t
            .render(&[msg(Role::Assistant, "x")])
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
    fn chat_parameters_become_completion_parameters_and_errors_name_them() -> anyhow::Result<()> {
        let req: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5, "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3, "stop": "x",
        }))?;
        assert_eq!(req.messages[0].content, Content("a\nb".into()));
        let c = completion_request(req, "p".into(), &["\n\n".into()], 100)?;
        assert_eq!(c.max_tokens, Some(7));
        assert_eq!(c.logprobs, Some(3));
        assert!(matches!(c.stop, Some(Stop::Many(ref v)) if v == &["x".to_string(), "\n\n".into()]));
        let req: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": "a"}], "top_logprobs": 3,
        }))?;
        assert!(
            completion_request(req, "p".into(), &[], 100).is_err_and(|e| e.to_string().contains("requires logprobs"))
        );
        let e = chat_error(
            ApiError::invalid("max_tokens", "max_tokens must be between 0 and 9, got 10"),
            true,
        );
        assert!(
            matches!(&e, ApiError::InvalidRequest { param: Some(p), message } if p == "max_completion_tokens" && message.starts_with("max_completion_tokens must"))
        );
        let image = serde_json::from_value::<ChatMessage>(serde_json::json!({
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]
        }));
        assert!(image.is_err_and(|e| e.to_string().contains("not supported")));
        Ok(())
    }
}
