//! OpenAI request and response shapes, the validation that turns a request into a job, and the
//! one place where errors become OpenAI's error body and an HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use headway_engine::EngineError;
use headway_model::{ModelError, SamplingParams};
use serde::{Deserialize, Serialize};

/// An error in OpenAI's body shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}` (the JSON answer
    /// and the last event of a stream alike).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// An engine error as the client sees it: 400 when the request is at fault (a prompt that does
/// not fit, an invalid setting), else 500.
impl From<&EngineError> for ApiError {
    fn from(error: &EngineError) -> Self {
        let param = match error {
            EngineError::Invalid { field, .. }
            | EngineError::Model(ModelError::Invalid { field, .. }) => Some(*field),
            _ => None,
        };
        let status = if error.is_invalid_request() {
            StatusCode::BAD_REQUEST
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        let kind = match status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            _ => "server_error",
        };
        Self {
            status,
            message: error.to_string(),
            kind,
            param,
            code: None,
        }
    }
}

/// A sampling setting the request got wrong, named.
impl From<ModelError> for ApiError {
    fn from(error: ModelError) -> Self {
        match error {
            ModelError::Invalid { field, message } => {
                Self::invalid(field, format!("{field} = {message}"))
            }
            other => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                other.to_string(),
            ),
        }
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Sampling and length fields shared by both endpoints. Numbers are read wide and checked here,
/// so errors can name the field and the allowed range.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerationFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension: keep only the K most likely tokens.
    pub top_k: Option<i64>,
    /// Extension (vLLM's): keep only tokens at least this fraction as likely as the top one.
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
}

/// `prompt`: a string or a one-element list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
}

/// Parses a request body as JSON (the fields are read with [`fields`]).
pub fn parse_body(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::invalid(
            "body",
            "the request body is not valid UTF-8",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("invalid JSON body: {e}")))
}

/// Reads the fields of `T` from a parsed body (unknown fields are ignored); an error names the
/// field (`temperature: invalid type: string "hot", expected f64`).
pub fn fields<T: serde::de::DeserializeOwned>(body: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let message = match e.path().to_string().as_str() {
            "." => format!("invalid request: {}", e.inner()),
            path => format!("{path}: {}", e.inner()),
        };
        ApiError::invalid("body", message)
    })
}

/// A validated request's generation settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// OpenAI's default temperature.
const DEFAULT_TEMPERATURE: f64 = 1.0;
const MAX_STOP_STRINGS: usize = 4;

impl GenerationFields {
    /// Checks every field; `max_context` bounds max_tokens.
    pub fn validate(&self, max_context: usize) -> Result<Settings, ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(
                "n",
                format!("n = {n}: only n = 1 is supported"),
            ));
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => None,
            Some(m) if m < 1 || m as u64 > max_context as u64 => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "max_tokens = {m}: must be between 1 and the context length {max_context}"
                    ),
                ))
            }
            Some(m) => Some(m as usize),
        };
        let top_k = match self.top_k {
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k = {k}: must be >= 0 (0: off)"),
                ))
            }
            Some(k) => k as usize,
            None => 0,
        };
        let sampling = SamplingParams::new(
            self.temperature.unwrap_or(DEFAULT_TEMPERATURE),
            top_k,
            self.top_p.unwrap_or(1.0),
            self.min_p.unwrap_or(0.0),
            self.seed.unwrap_or(0) as u64,
        )?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop",
                format!("stop: at most {MAX_STOP_STRINGS} non-empty strings"),
            ));
        }
        Ok(Settings {
            max_tokens,
            sampling,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        })
    }
}

impl ChatMessage {
    /// The message's text (text parts joined).
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(text)) => Ok(text.clone()),
            Some(Content::Parts(parts)) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(text)) => Ok(text.as_str()),
                    (kind, _) => Err(ApiError::invalid(
                        "messages",
                        format!("content part of type {kind:?}: only text parts are supported"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|parts| parts.concat()),
        }
    }
}

impl PromptField {
    pub fn text(&self) -> Result<&str, ApiError> {
        match self {
            Self::One(text) => Ok(text),
            Self::Many(list) if list.len() == 1 => Ok(&list[0]),
            Self::Many(list) => Err(ApiError::invalid(
                "prompt",
                format!(
                    "{} prompts: one prompt per request is supported",
                    list.len()
                ),
            )),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// Extension: how speculation went for this request.
#[derive(Debug, Clone, Serialize)]
pub struct Speculative {
    pub method: String,
    pub target_forwards: usize,
    /// Accepted draft tokens among the completion tokens.
    pub accepted_tokens: usize,
    /// Tokens per target forward (plain decoding: 1).
    pub tau: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Engine errors map to a status in one place: the request's fault is a 400 naming the field,
    /// anything else a 500; the JSON answer and a stream's last event carry the same body.
    #[test]
    fn engine_errors_get_the_status_of_their_kind() {
        let request = EngineError::Model(ModelError::Invalid {
            field: "max_new_tokens",
            message: "too many".into(),
        });
        let error = ApiError::from(&request);
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert_eq!(error.body()["error"]["param"], "max_new_tokens");
        assert_eq!(error.body()["error"]["type"], "invalid_request_error");
        let server = EngineError::file("/heads/model.safetensors", "unreadable");
        let error = ApiError::from(&server);
        assert_eq!(error.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(error.body()["error"]["type"], "server_error");
        assert!(error.body()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unreadable"));
    }

    #[test]
    fn sampling_fields_are_checked_by_the_one_sampling_type() {
        let fields =
            |json: serde_json::Value| -> GenerationFields { serde_json::from_value(json).unwrap() };
        let settings = fields(serde_json::json!({"temperature": 0.5, "min_p": 0.2, "top_k": 4}))
            .validate(64)
            .unwrap();
        assert_eq!(
            settings.sampling,
            SamplingParams::new(0.5, 4, 1.0, 0.2, 0).unwrap()
        );
        for (json, field) in [
            (serde_json::json!({"min_p": 1.5}), "min_p"),
            (serde_json::json!({"top_p": 0}), "top_p"),
            (serde_json::json!({"temperature": -0.1}), "temperature"),
            (serde_json::json!({"top_k": -1}), "top_k"),
        ] {
            let error = fields(json).validate(64).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST);
            assert_eq!(error.param, Some(field));
            assert!(error.message.contains(field), "{}", error.message);
        }
    }
}
