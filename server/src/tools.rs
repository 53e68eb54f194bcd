//! Tool calls: chat's `tools` and `tool_choice` as a grammar the output follows, and the output
//! read back as OpenAI's `tool_calls`.
//!
//! - A named function (`{"type": "function", "function": {"name": ...}}`): the output is that
//!   function's arguments, a JSON object valid against its `parameters` schema (as vLLM does it).
//! - `"required"`: a JSON array of one call or more, `[{"name": ..., "parameters": {...}}]`,
//!   each call's parameters valid against its function's schema (vLLM's format).
//! - `"auto"` (the default with tools): plain text, or one call or more, each written
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format that Qwen's
//!   and NousResearch's templates teach); a text may not begin with `<tool_call>` otherwise.
//! - `"none"`: no calls; the tools still reach the chat template.

use serde_json::{json, Map, Value};

use crate::api::{FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta};
use crate::engine::constraint::Grammar;
use crate::error::ApiError;
use crate::structured::Requested;

/// How the turn's output is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Named(String),
    Required,
    Auto,
}

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One offered function.
struct Function {
    name: String,
    parameters: Value,
}

fn invalid(field: String, message: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(field.clone(), format!("{field}: {message}"))
}

fn functions(tools: &[Value]) -> Result<Vec<Function>, ApiError> {
    let mut out: Vec<Function> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(at(".type"), "must be \"function\""));
        }
        let function = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(at(".function"), "must be an object"))?;
        let name = function.get("name").and_then(Value::as_str).unwrap_or_default();
        let valid =
            (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(invalid(
                at(".function.name"),
                format!("{name:?} must be 1 to 64 letters, digits, `_` or `-`"),
            ));
        }
        if out.iter().any(|f| f.name == name) {
            return Err(invalid(at(".function.name"), format!("{name:?} is offered twice")));
        }
        // Without parameters, a function takes none (OpenAI's rule).
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => return Err(invalid(at(".function.parameters"), "must be a JSON schema object")),
        };
        out.push(Function {
            name: name.to_string(),
            parameters,
        });
    }
    Ok(out)
}

/// `schema`'s own definitions (`$defs`, `definitions`) moved out under names prefixed with
/// `prefix`, and its references to them rewritten to match: a function's parameter schema nested
/// in a larger one keeps its references (which point at the document's root).
fn hoist_definitions(schema: &mut Value, prefix: &str, defs: &mut Map<String, Value>) {
    fn rewrite(v: &mut Value, prefix: &str) {
        match v {
            Value::Object(o) => {
                for (k, child) in o.iter_mut() {
                    match (k.as_str(), child) {
                        ("$ref", Value::String(r)) => {
                            for root in ["#/$defs/", "#/definitions/"] {
                                if let Some(name) = r.strip_prefix(root) {
                                    *r = format!("#/$defs/{prefix}{name}");
                                    break;
                                }
                            }
                        }
                        (_, child) => rewrite(child, prefix),
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| rewrite(i, prefix)),
            _ => {}
        }
    }
    rewrite(schema, prefix);
    if let Some(o) = schema.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(own)) = o.remove(key) {
                defs.extend(own.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)));
            }
        }
    }
}

/// A schema of one call of any of `functions`, `{name: <const>, <key>: <its parameters>}`, with
/// every function's definitions at the root.
fn call_schema(functions: &[Function], key: &str) -> (Value, Map<String, Value>) {
    let mut defs = Map::new();
    let calls: Vec<Value> = functions
        .iter()
        .map(|f| {
            let mut parameters = f.parameters.clone();
            hoist_definitions(&mut parameters, &format!("{}__", f.name), &mut defs);
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, key: parameters},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    (json!({"anyOf": calls}), defs)
}

/// The request's tools as the grammar of its output and the way to read it back; `None` where
/// there are no calls to make (no tools, or `tool_choice: "none"`).
pub fn plan(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<(Mode, Requested)>, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.is_empty() {
        return match choice {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(_) => Err(ApiError::invalid(
                "tool_choice",
                "tool_choice needs `tools` to choose from",
            )),
        };
    }
    let functions = functions(tools)?;
    let parallel = parallel.unwrap_or(true);
    let requested = |grammar| Requested {
        field: "tools".into(),
        grammar,
    };
    let mode = match choice {
        None | Some(Value::Null) => Mode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Mode::Auto,
            "required" => Mode::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names {name:?}, which is not among the tools"),
                ));
            }
            Mode::Named(name.to_string())
        }
    };
    let grammar = match &mode {
        Mode::Named(name) => {
            let f = functions.iter().find(|f| &f.name == name).map(|f| &f.parameters);
            Grammar::JsonSchema(f.unwrap_or(&Value::Null).to_string())
        }
        Mode::Required => {
            let (call, defs) = call_schema(&functions, "parameters");
            let mut schema = json!({"type": "array", "items": call, "minItems": 1});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            if !defs.is_empty() {
                schema["$defs"] = Value::Object(defs);
            }
            Grammar::JsonSchema(schema.to_string())
        }
        Mode::Auto => {
            let (mut call, defs) = call_schema(&functions, "arguments");
            if !defs.is_empty() {
                call["$defs"] = Value::Object(defs);
            }
            crate::engine::constraint::compact_json(&mut call);
            let repeat = if parallel { "+" } else { "" };
            Grammar::Lark(format!(
                "start: TEXT | calls\n\
                 calls: call{repeat}\n\
                 call: {open} body {close}\n\
                 body: %json {call}\n\
                 TEXT: /(?s:.*)/ & ~/(?s:{open_rx}.*)/\n",
                open = Value::from(CALL_OPEN),
                close = Value::from(CALL_CLOSE),
                open_rx = CALL_OPEN.replace('/', "\\/"),
            ))
        }
    };
    Ok(Some((mode, requested(grammar))))
}

/// An id for a call (as OpenAI's: `call_` and random characters).
fn call_id() -> String {
    format!("call_{:016x}{:08x}", rand::random::<u64>(), rand::random::<u32>())
}

/// The calls in a finished output, or `None` where the output is text (or, cut short, does not
/// parse).
pub fn parse(mode: &Mode, text: &str) -> Option<Vec<ToolCall>> {
    let call = |name: &str, arguments: String| ToolCall {
        id: call_id(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.to_string(),
            arguments,
        },
    };
    match mode {
        // The arguments as generated (and as streamed), once they parse.
        Mode::Named(name) => serde_json::from_str::<Value>(text)
            .ok()
            .map(|_| vec![call(name, text.to_string())]),
        Mode::Required => {
            let calls: Vec<Value> = serde_json::from_str(text).ok()?;
            calls
                .iter()
                .map(|c| Some(call(c.get("name")?.as_str()?, c.get("parameters")?.to_string())))
                .collect()
        }
        Mode::Auto => {
            let mut rest = text.trim_end().strip_prefix(CALL_OPEN)?;
            let mut calls = Vec::new();
            loop {
                let (body, after) = rest.split_once(CALL_CLOSE)?;
                let c: Value = serde_json::from_str(body).ok()?;
                calls.push(call(c.get("name")?.as_str()?, c.get("arguments")?.to_string()));
                match after.strip_prefix(CALL_OPEN) {
                    Some(next) => rest = next,
                    None if after.trim().is_empty() => return Some(calls),
                    None => return None,
                }
            }
        }
    }
}

/// The calls as stream deltas, each whole in one delta (`required` and `auto` are read once
/// the output is complete).
pub fn deltas(calls: Vec<ToolCall>) -> Vec<ToolCallDelta> {
    (calls.into_iter().enumerate())
        .map(|(i, c)| ToolCallDelta {
            index: i as u32,
            id: Some(c.id),
            kind: Some(c.kind),
            function: FunctionCallDelta {
                name: Some(c.function.name),
                arguments: Some(c.function.arguments),
            },
        })
        .collect()
}

/// One choice's stream under tools: a named function's arguments go out as they come (the
/// first delta with the call's id and name); `required` and `auto` output is held until it is
/// known to be calls (and then sent whole) or, for `auto`, text (then sent as content).
#[derive(Debug, Default)]
pub struct StreamedChoice {
    held: String,
    /// The call's id, once its first delta went out (named function).
    started: Option<String>,
    /// `auto` output that turned out to be text: content from here on.
    text: bool,
}

/// What a stream delta becomes.
#[derive(Debug, Default, PartialEq)]
pub struct Out {
    pub content: Option<String>,
    pub calls: Option<Vec<ToolCallDelta>>,
}

impl StreamedChoice {
    /// `text` added to the choice; `finished` when it is the choice's last delta (and it ended
    /// with "stop": the output is complete).
    pub fn push(&mut self, mode: &Mode, text: &str, finished: Option<bool>) -> Out {
        match mode {
            Mode::Named(name) => {
                if text.is_empty() && self.started.is_some() {
                    return Out::default();
                }
                let first = self.started.is_none();
                let id = self.started.get_or_insert_with(call_id).clone();
                Out {
                    content: None,
                    calls: Some(vec![ToolCallDelta {
                        index: 0,
                        id: first.then_some(id),
                        kind: first.then(|| "function".to_string()),
                        function: FunctionCallDelta {
                            name: first.then(|| name.clone()),
                            arguments: Some(text.to_string()),
                        },
                    }]),
                }
            }
            Mode::Required | Mode::Auto => {
                if self.text {
                    return Out {
                        content: Some(text.to_string()),
                        calls: None,
                    };
                }
                self.held.push_str(text);
                if *mode == Mode::Auto && !self.held.starts_with(CALL_OPEN) && !CALL_OPEN.starts_with(&*self.held) {
                    self.text = true;
                    return Out {
                        content: Some(std::mem::take(&mut self.held)),
                        calls: None,
                    };
                }
                match finished {
                    None => Out::default(),
                    Some(complete) => match parse(mode, &self.held).filter(|_| complete) {
                        Some(calls) => Out {
                            content: None,
                            calls: Some(deltas(calls)),
                        },
                        // Cut short: what there is, as text.
                        None => Out {
                            content: Some(std::mem::take(&mut self.held)),
                            calls: None,
                        },
                    },
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                "required": ["city"], "$defs": {"Unit": {"enum": ["C", "F"]}}}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ]
    }

    #[test]
    fn each_choice_gives_its_grammar() -> Result<(), ApiError> {
        let t = tools();
        assert_eq!(plan(Some(&t), Some(&json!("none")), None)?, None);
        assert_eq!(plan(None, None, None)?, None);
        let named = json!({"type": "function", "function": {"name": "now"}});
        let Some((mode, r)) = plan(Some(&t), Some(&named), None)? else {
            panic!("a named function constrains the output")
        };
        assert_eq!(mode, Mode::Named("now".into()));
        assert_eq!(
            r.grammar,
            Grammar::JsonSchema(r#"{"type":"object","properties":{}}"#.into())
        );
        let Some((Mode::Required, r)) = plan(Some(&t), Some(&json!("required")), Some(false))? else {
            panic!("required is a mode")
        };
        let Grammar::JsonSchema(schema) = r.grammar else {
            panic!("a schema")
        };
        let schema: Value = serde_json::from_str(&schema).map_err(|e| ApiError::Internal(e.to_string()))?;
        assert_eq!(schema["maxItems"], 1);
        // The function's own definitions moved to the root, its reference rewritten.
        assert_eq!(schema["$defs"]["get_weather__Unit"], json!({"enum": ["C", "F"]}));
        assert_eq!(
            schema["items"]["anyOf"][0]["properties"]["parameters"]["properties"]["unit"]["$ref"],
            "#/$defs/get_weather__Unit"
        );
        let Some((Mode::Auto, r)) = plan(Some(&t), None, None)? else {
            panic!("auto is the default")
        };
        let Grammar::Lark(lark) = r.grammar else {
            panic!("a Lark grammar")
        };
        assert!(lark.contains("calls: call+") && lark.contains("%json {"), "{lark}");
        Ok(())
    }

    #[test]
    fn bad_tools_name_the_field() {
        let err = |tools: Value, choice: Value| {
            let tools: Vec<Value> = serde_json::from_value(tools).unwrap_or_default();
            match plan(Some(&tools), Some(&choice), None) {
                Err(ApiError::InvalidRequest { param, message }) => (param.unwrap_or_default(), message),
                other => panic!("{other:?}"),
            }
        };
        let (p, _) = err(json!([{"type": "retrieval"}]), Value::Null);
        assert_eq!(p, "tools[0].type");
        let (p, m) = err(json!([{"type": "function", "function": {"name": "a b"}}]), Value::Null);
        assert_eq!(p, "tools[0].function.name");
        assert!(m.contains("letters"), "{m}");
        let (p, m) = err(
            json!([{"type": "function", "function": {"name": "f"}}]),
            json!({"type": "function", "function": {"name": "g"}}),
        );
        assert_eq!(p, "tool_choice");
        assert!(m.contains("\"g\""), "{m}");
        let (p, _) = err(
            json!([{"type": "function", "function": {"name": "f"}}]),
            json!("sometimes"),
        );
        assert_eq!(p, "tool_choice");
        assert!(plan(None, Some(&json!("required")), None).is_err());
    }

    #[test]
    fn outputs_read_back_as_calls() {
        let names = |calls: Option<Vec<ToolCall>>| -> Vec<(String, String)> {
            calls
                .unwrap_or_default()
                .into_iter()
                .map(|c| (c.function.name, c.function.arguments))
                .collect()
        };
        assert_eq!(
            names(parse(&Mode::Named("f".into()), r#"{"x":1}"#)),
            [("f".to_string(), r#"{"x":1}"#.to_string())]
        );
        assert_eq!(
            names(parse(
                &Mode::Required,
                r#"[{"name":"a","parameters":{}},{"name":"b","parameters":{"y":2}}]"#
            )),
            [("a".into(), "{}".into()), ("b".into(), r#"{"y":2}"#.into())]
        );
        let auto = r#"<tool_call>{"name":"a","arguments":{"z":"w"}}</tool_call><tool_call>{"name":"b","arguments":{}}</tool_call>"#;
        assert_eq!(
            names(parse(&Mode::Auto, auto)),
            [("a".into(), r#"{"z":"w"}"#.into()), ("b".into(), "{}".into())]
        );
        assert_eq!(parse(&Mode::Auto, "Just text."), None);
        assert_eq!(parse(&Mode::Auto, "<tool_call>{\"name\":"), None);
    }

    #[test]
    fn streams_send_arguments_as_they_come_or_whole_calls_at_the_end() {
        let mut named = StreamedChoice::default();
        let mode = Mode::Named("f".into());
        let first = named.push(&mode, "{\"x\"", None);
        let calls = first.calls.unwrap_or_default();
        assert!(calls[0].id.is_some() && calls[0].function.name.as_deref() == Some("f"));
        let second = named.push(&mode, ":1}", Some(true)).calls.unwrap_or_default();
        assert_eq!(
            (second[0].id.clone(), second[0].function.arguments.as_deref()),
            (None, Some(":1}"))
        );

        let mut auto = StreamedChoice::default();
        assert_eq!(
            auto.push(&Mode::Auto, "<tool", None),
            Out::default(),
            "held: may start a call"
        );
        assert_eq!(
            auto.push(&Mode::Auto, "_call>{\"name\":\"a\",\"arguments\":{}}", None),
            Out::default()
        );
        let end = auto.push(&Mode::Auto, "</tool_call>", Some(true));
        assert_eq!(end.calls.map(|c| c.len()), Some(1));

        let mut text = StreamedChoice::default();
        assert_eq!(text.push(&Mode::Auto, "<b", None).content.as_deref(), Some("<b"));
        assert_eq!(
            text.push(&Mode::Auto, "old", Some(true)).content.as_deref(),
            Some("old")
        );
    }
}
