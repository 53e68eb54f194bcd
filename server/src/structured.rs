//! Structured outputs as clients ask for them, each turned into the one [`Grammar`] the engine
//! enforces: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
//! `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
//! `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and llama.cpp's `json_schema`
//! and `grammar` (GBNF). One constraint per request; errors name the field and the problem.

use serde_json::{Map, Value};

use std::sync::Arc;

use crate::api::CompletionRequest;
use crate::engine::constraint::{Compiled, Grammar, Grammars};
use crate::error::ApiError;

/// The longest schema or grammar text a request may give (limits table).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// What a request asks its output to follow, and the field that asked (errors name it).
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub field: String,
    pub grammar: Grammar,
}

/// The structured-output fields of a request (completions and chat share them).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fields<'a> {
    pub response_format: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
    pub guided_json: Option<&'a Value>,
    pub guided_regex: Option<&'a str>,
    pub guided_choice: Option<&'a [String]>,
    pub guided_grammar: Option<&'a str>,
    pub json_schema: Option<&'a Value>,
    pub grammar: Option<&'a str>,
}

fn invalid(field: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(field, format!("{field}: {message}"))
}

fn checked_size(field: &str, text: String) -> Result<String, ApiError> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(invalid(
            field,
            format!(
                "{} bytes, more than the {MAX_GRAMMAR_BYTES} this server compiles",
                text.len()
            ),
        ));
    }
    Ok(text)
}

/// A JSON schema given as an object (or, as vLLM also takes it, as a string of JSON).
fn schema(field: &str, v: &Value) -> Result<Grammar, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| invalid(field, format!("not JSON: {e}")))?,
        other => other.clone(),
    };
    if !(v.is_object() || v.is_boolean()) {
        return Err(invalid(field, "a JSON schema must be an object"));
    }
    Ok(Grammar::JsonSchema(checked_size(field, v.to_string())?))
}

fn regex(field: &str, rx: &str) -> Result<Grammar, ApiError> {
    Ok(Grammar::Regex(checked_size(field, rx.to_string())?))
}

/// One of several strings exactly: a Lark alternation of JSON-quoted literals.
fn choice(field: &str, choices: &[String]) -> Result<Grammar, ApiError> {
    if choices.is_empty() {
        return Err(invalid(field, "needs at least one choice"));
    }
    if choices.iter().any(String::is_empty) {
        return Err(invalid(field, "a choice must not be empty"));
    }
    let quoted: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
    Ok(Grammar::Lark(checked_size(
        field,
        format!("start: {}", quoted.join(" | ")),
    )?))
}

/// A grammar in GBNF (llama.cpp's; recognised by its `::=`) or in llguidance's Lark.
fn grammar(field: &str, text: &str) -> Result<Grammar, ApiError> {
    let text = checked_size(field, text.to_string())?;
    if text.contains("::=") {
        return Ok(Grammar::Lark(
            crate::gbnf::to_lark(&text).map_err(|e| invalid(field, e))?,
        ));
    }
    Ok(Grammar::Lark(text))
}

fn object<'a>(field: &str, v: &'a Value) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| invalid(field, "must be an object"))
}

/// OpenAI's strict mode: an object has only the properties its schema names (OpenAI requires
/// `additionalProperties: false` on every object in a strict schema; one left out means the same
/// here, instead of an error). Walks the whole schema, definitions included.
fn closed_objects(schema: &mut Value) {
    match schema {
        Value::Object(o) => {
            let is_object = o.get("type").and_then(Value::as_str) == Some("object") || o.contains_key("properties");
            if is_object && !o.contains_key("additionalProperties") {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            o.values_mut().for_each(closed_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(closed_objects),
        _ => {}
    }
}

/// OpenAI's `response_format` (and llama.cpp's `json_object` with a `schema` in it).
fn response_format(v: &Value) -> Result<Option<Requested>, ApiError> {
    const FIELD: &str = "response_format";
    let o = object(FIELD, v)?;
    let kind = o.get("type").and_then(Value::as_str);
    let grammar = match kind {
        Some("text") => return Ok(None),
        Some("json_object") => match o.get("schema") {
            Some(s) => schema("response_format.schema", s)?,
            None => Grammar::JsonSchema(r#"{"type":"object"}"#.into()),
        },
        Some("json_schema") => {
            let spec = o
                .get("json_schema")
                .ok_or_else(|| invalid(FIELD, "type json_schema needs a `json_schema` object"))?;
            let spec = object("response_format.json_schema", spec)?;
            let strict = match spec.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(invalid(
                        "response_format.json_schema.strict",
                        format!("must be a boolean, got {other}"),
                    ))
                }
            };
            // Without a schema (OpenAI allows it): any JSON value.
            let mut given = spec.get("schema").cloned().unwrap_or(Value::Object(Map::new()));
            if strict {
                closed_objects(&mut given);
            }
            schema("response_format.json_schema.schema", &given)?
        }
        Some("structural_tag") => {
            return Err(invalid(
                FIELD,
                "structural tags are not supported; use a json_schema or a grammar",
            ))
        }
        _ => {
            return Err(invalid(
                FIELD,
                format!(
                    "type must be \"text\", \"json_object\" or \"json_schema\", got {}",
                    o.get("type").unwrap_or(&Value::Null)
                ),
            ))
        }
    };
    Ok(Some(Requested {
        field: FIELD.into(),
        grammar,
    }))
}

/// vLLM's `structured_outputs`: exactly one of its constraint keys.
fn structured_outputs(v: &Value) -> Result<Option<Requested>, ApiError> {
    const FIELD: &str = "structured_outputs";
    let o = object(FIELD, v)?;
    let mut found: Vec<Requested> = Vec::new();
    for (key, value) in o {
        let field = format!("{FIELD}.{key}");
        let grammar = match key.as_str() {
            "json" => schema(&field, value)?,
            "regex" => regex(
                &field,
                value.as_str().ok_or_else(|| invalid(&field, "must be a string"))?,
            )?,
            "choice" => {
                let items: Vec<String> = serde_json::from_value(value.clone())
                    .map_err(|_| invalid(&field, "must be an array of strings"))?;
                choice(&field, &items)?
            }
            "grammar" => grammar(
                &field,
                value.as_str().ok_or_else(|| invalid(&field, "must be a string"))?,
            )?,
            "json_object" => match value {
                Value::Bool(true) => Grammar::JsonSchema(r#"{"type":"object"}"#.into()),
                Value::Bool(false) | Value::Null => continue,
                _ => return Err(invalid(&field, "must be a boolean")),
            },
            // The engine writes JSON without free whitespace, and falls back to nothing.
            "disable_any_whitespace" | "disable_fallback" => {
                if !(value.is_boolean() || value.is_null()) {
                    return Err(invalid(&field, "must be a boolean"));
                }
                continue;
            }
            "structural_tag" => return Err(invalid(&field, "structural tags are not supported")),
            "whitespace_pattern" | "disable_additional_properties" => {
                return Err(invalid(
                    &field,
                    "is not supported: JSON is written compactly, as the schema allows",
                ))
            }
            _ => {
                return Err(invalid(
                    &field,
                    "unknown key (known: json, regex, choice, grammar, json_object)",
                ))
            }
        };
        found.push(Requested { field, grammar });
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(invalid(
            FIELD,
            format!(
                "give one constraint, not {}",
                found.iter().map(|r| r.field.as_str()).collect::<Vec<_>>().join(" and ")
            ),
        )),
    }
}

/// The request's one constraint, if any. Two constraints in one request are an error naming both.
pub fn requested(f: Fields<'_>) -> Result<Option<Requested>, ApiError> {
    let named = |field: &str, grammar: Option<Result<Grammar, ApiError>>| {
        Ok::<_, ApiError>(grammar.transpose()?.map(|grammar| Requested {
            field: field.into(),
            grammar,
        }))
    };
    let all = [
        f.response_format.map(response_format).transpose()?.flatten(),
        f.structured_outputs.map(structured_outputs).transpose()?.flatten(),
        named("guided_json", f.guided_json.map(|v| schema("guided_json", v)))?,
        named("guided_regex", f.guided_regex.map(|r| regex("guided_regex", r)))?,
        named("guided_choice", f.guided_choice.map(|c| choice("guided_choice", c)))?,
        named("guided_grammar", f.guided_grammar.map(|g| grammar("guided_grammar", g)))?,
        named("json_schema", f.json_schema.map(|v| schema("json_schema", v)))?,
        named("grammar", f.grammar.map(|g| grammar("grammar", g)))?,
    ];
    let mut given: Vec<Requested> = all.into_iter().flatten().collect();
    if given.len() > 1 {
        let names: Vec<&str> = given.iter().map(|r| r.field.as_str()).collect();
        return Err(ApiError::invalid(
            names[1],
            format!(
                "one structured-output constraint per request, got {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(given.pop())
}

/// The request's structured-output constraint, compiled (from the cache where it was compiled
/// before): an invalid schema, regex or grammar, one beyond the limits, or two constraints in one
/// request is an error that names the field, before anything is generated.
pub fn compile(
    req: &CompletionRequest,
    grammars: &Grammars,
    tools: Option<Requested>,
) -> Result<Option<Arc<Compiled>>, ApiError> {
    let asked = requested(Fields {
        response_format: req.response_format.as_ref(),
        structured_outputs: req.structured_outputs.as_ref(),
        guided_json: req.guided_json.as_ref(),
        guided_regex: req.guided_regex.as_deref(),
        guided_choice: req.guided_choice.as_deref(),
        guided_grammar: req.guided_grammar.as_deref(),
        json_schema: req.json_schema.as_ref(),
        grammar: req.grammar.as_deref(),
    })?;
    let asked = match (asked, tools) {
        (Some(a), Some(t)) => {
            return Err(ApiError::invalid(
                a.field.clone(),
                format!("{} and {} both constrain the output; give one", t.field, a.field),
            ))
        }
        (a, t) => a.or(t),
    };
    let Some(asked) = asked else { return Ok(None) };
    if req.allowed_token_ids.is_some() {
        return Err(ApiError::invalid(
            "allowed_token_ids",
            format!(
                "allowed_token_ids and {} both constrain the output; give one",
                asked.field
            ),
        ));
    }
    grammars
        .compile(&asked.grammar)
        .map(Some)
        .map_err(|e| ApiError::invalid(asked.field.clone(), format!("{}: {e}", asked.field)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(e: ApiError) -> String {
        e.to_string()
    }

    #[test]
    fn each_form_becomes_its_grammar() -> Result<(), ApiError> {
        // strict closes every object that does not say otherwise.
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema":
            {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
             "$defs": {"b": {"type": "object", "additionalProperties": true}}}}});
        let r = requested(Fields {
            response_format: Some(&rf),
            ..Fields::default()
        })?;
        let Some(Grammar::JsonSchema(text)) = r.map(|r| r.grammar) else {
            panic!("a schema")
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| ApiError::Internal(e.to_string()))?;
        assert_eq!(v["additionalProperties"], false);
        assert_eq!(v["properties"]["a"]["additionalProperties"], false);
        assert_eq!(v["$defs"]["b"]["additionalProperties"], true);
        let rf =
            json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "integer"}}});
        let r = requested(Fields {
            response_format: Some(&rf),
            ..Fields::default()
        })?;
        assert_eq!(
            r.map(|r| r.grammar),
            Some(Grammar::JsonSchema(r#"{"type":"integer"}"#.into()))
        );
        let text = json!({"type": "text"});
        assert_eq!(
            requested(Fields {
                response_format: Some(&text),
                ..Fields::default()
            })?,
            None
        );
        let so = json!({"choice": ["a\"b", "c"]});
        let r = requested(Fields {
            structured_outputs: Some(&so),
            ..Fields::default()
        })?;
        assert_eq!(
            r,
            Some(Requested {
                field: "structured_outputs.choice".into(),
                grammar: Grammar::Lark(r#"start: "a\"b" | "c""#.into())
            })
        );
        let r = requested(Fields {
            grammar: Some("root ::= \"x\""),
            ..Fields::default()
        })?;
        assert_eq!(
            r.map(|r| r.grammar),
            Some(Grammar::Lark("start: g_root\ng_root: \"x\"\n".into()))
        );
        let r = requested(Fields {
            guided_grammar: Some("start: \"x\""),
            ..Fields::default()
        })?;
        assert_eq!(r.map(|r| r.grammar), Some(Grammar::Lark("start: \"x\"".into())));
        Ok(())
    }

    #[test]
    fn bad_input_names_the_field() {
        let two = requested(Fields {
            guided_regex: Some("a"),
            json_schema: Some(&json!({"type": "object"})),
            ..Fields::default()
        });
        let e = message(two.err().unwrap_or(ApiError::Internal(String::new())));
        assert!(e.contains("guided_regex and json_schema"), "{e}");
        let cases = [
            (json!({"type": "xml"}), "type must be"),
            (json!({"type": "json_schema"}), "needs a `json_schema` object"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "must be an object",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
                "strict: must be a boolean",
            ),
        ];
        for (rf, want) in cases {
            let e = requested(Fields {
                response_format: Some(&rf),
                ..Fields::default()
            });
            let e = message(e.err().unwrap_or(ApiError::Internal(String::new())));
            assert!(e.contains(want), "{rf}: {e}");
        }
        let so = [
            (json!({"regex": "a", "choice": ["b"]}), "give one constraint"),
            (json!({"choice": []}), "at least one choice"),
            (json!({"choice": "a"}), "array of strings"),
            (json!({"colour": "red"}), "structured_outputs.colour: unknown key"),
            (
                json!({"grammar": "root ::= nothing"}),
                "`nothing` is used but not defined",
            ),
        ];
        for (v, want) in so {
            let e = requested(Fields {
                structured_outputs: Some(&v),
                ..Fields::default()
            });
            let e = message(e.err().unwrap_or(ApiError::Internal(String::new())));
            assert!(e.contains(want), "{v}: {e}");
        }
        let big = "a".repeat(MAX_GRAMMAR_BYTES + 1);
        let e = requested(Fields {
            guided_regex: Some(&big),
            ..Fields::default()
        });
        assert!(message(e.err().unwrap_or(ApiError::Internal(String::new()))).contains("more than the"));
    }
}
