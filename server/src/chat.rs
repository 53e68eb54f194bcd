//! `POST /v1/chat/completions`: the messages are rendered to one prompt by the checkpoint's chat
//! template ([`gpt::chat`], the code gpt-train renders its conversations with), the request
//! becomes a completion request, and the completions engine and fold do the rest;
//! this module shapes their output as chat responses and chunks.

use gpt::chat::{Message, RenderOptions};

use crate::api::*;
use crate::error::ApiError;
use crate::fold::Delta;
use crate::tools::{self, Mode, StreamedChoice};

/// A request's messages as the chat template sees them (`gpt::chat`, which gpt-train renders
/// its conversations with too).
pub fn messages(messages: &[ChatMessage]) -> Vec<Message> {
    messages
        .iter()
        .map(|m| Message {
            role: m.role.as_str().to_string(),
            content: m.content.0.clone(),
            name: m.name.clone(),
            tool_calls: m.tool_calls.clone(),
            tool_call_id: m.tool_call_id.clone(),
        })
        .collect()
}

/// How a chat request asks for its conversation to be rendered (its fields are taken out of it).
pub fn render_options(req: &mut ChatCompletionRequest) -> RenderOptions {
    let continue_final_message = req.continue_final_message.unwrap_or(false);
    RenderOptions {
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
