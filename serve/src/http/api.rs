//! OpenAI request and response shapes, and the validation that turns a request into a job.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        (self.status, axum::Json(body)).into_response()
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
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub seed: u64,
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
        let temperature = self.temperature.unwrap_or(DEFAULT_TEMPERATURE);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature = {temperature}: must be between 0 and 2"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p = {top_p}: must be in (0, 1]"),
            ));
        }
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
            temperature,
            top_p,
            top_k,
            seed: self.seed.unwrap_or(0) as u64,
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
    pub accepted_tokens: usize,
    /// Tokens per target forward (plain decoding: 1).
    pub tau: f64,
}
