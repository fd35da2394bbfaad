//! `headway-serve http`: an OpenAI-compatible server in front of the speculative engine.
//!
//! Handlers validate and tokenize a request, queue it for the engine thread ([`worker`]) and
//! relay what it produces, as one JSON body or as server-sent events. A client that goes away
//! closes its event channel, which the engine notices at its next token and stops.

pub mod api;
pub mod load;
pub mod metrics;
pub mod stop;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use headway_model::{ChatTemplate, Message, TextTokenizer};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use api::{
    fields, parse_body, ApiError, ChatRequest, CompletionRequest, GenerationFields, Settings,
    Speculative, Usage,
};
use metrics::Metrics;
use worker::{submit, Engine, Event, Finished, Job, QueueLimits, Refused};

/// Server options (the CLI's `http` arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    #[command(flatten)]
    pub target: headway_model::TargetArgs,
    #[command(flatten)]
    pub draft: crate::options::DraftArgs,
    /// Address to bind (loopback by default: put a proxy in front to expose it).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (also read from
    /// HEADWAY_API_KEY).
    #[arg(long, env = "HEADWAY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests decoded at once (continuous batching: each step verifies every running
    /// request's tree in one target forward); 1 serves them one after another.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_batch: u16,
    /// Requests waiting for the engine beyond the running batch; more get 429.
    #[arg(long, default_value_t = 32)]
    pub max_queue: usize,
    /// Longest prompt + completion in tokens (default: the model's context length).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Completion length when a request gives no max_tokens.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
}

/// What every handler shares.
struct AppState {
    queue: std::sync::mpsc::SyncSender<Job>,
    tokenizer: TextTokenizer,
    chat_template: Option<ChatTemplate>,
    model_name: String,
    method: String,
    max_context: usize,
    default_max_tokens: usize,
    api_key: Option<String>,
    metrics: Arc<Metrics>,
    started: u64,
}

/// Runs the server until SIGTERM or Ctrl-C, then lets in-flight requests finish and returns.
pub fn run(args: HttpArgs) -> anyhow::Result<()> {
    // The tokenizer and template that validate requests here; the engine loads the weights.
    let parts = headway_gguf::target_parts(&args.target.path())?;
    let context_length = parts.config.max_position_embeddings;
    let max_context = args
        .max_context
        .unwrap_or(context_length)
        .min(context_length);
    let metrics = Arc::new(Metrics::default());
    let engine = Engine::start(
        args.target.clone(),
        args.draft.clone(),
        max_context,
        QueueLimits {
            max_batch: usize::from(args.max_batch),
            max_queue: args.max_queue,
        },
        metrics.clone(),
    )?;
    let state = Arc::new(AppState {
        queue: engine.queue.clone(),
        tokenizer: parts.tokenizer,
        chat_template: parts.chat_template,
        model_name: engine.model_name.clone(),
        method: engine.method.clone(),
        max_context,
        default_max_tokens: args.default_max_tokens,
        api_key: args.api_key.clone(),
        metrics,
        started: unix_time(),
    });
    let Engine { queue, thread, .. } = engine;
    drop(queue);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let address: SocketAddr = format!("{}:{}", args.host, args.port).parse()?;
        let listener = tokio::net::TcpListener::bind(address).await?;
        tracing::info!(
            address = %listener.local_addr()?,
            model = %state.model_name,
            method = %state.method,
            max_context,
            max_batch = args.max_batch,
            max_queue = args.max_queue,
            api_key = state.api_key.is_some(),
            "headway-serve http listening"
        );
        axum::serve(listener, router(state, args.max_body_bytes))
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        anyhow::Ok(())
    })?;
    // Every queue sender is gone with the router: the engine drains and stops.
    thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    tracing::info!("shut down");
    Ok(())
}

fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(render_metrics))
        .fallback(unknown_path)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown requested: finishing in-flight requests");
}

/// API key check on every path but `/health` (a load balancer's probe carries no key), and
/// request counting by path and status.
async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    let authorized = match &state.api_key {
        Some(key) if path != "/health" => request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .is_some_and(|given| key_matches(given, key.as_bytes())),
        _ => true,
    };
    let response = if authorized {
        next.run(request).await
    } else {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or incorrect API key: send `Authorization: Bearer KEY`",
        )
        .into_response()
    };
    let known = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/metrics",
    ];
    let label = if known.contains(&path.as_str()) {
        path.as_str()
    } else {
        "other"
    };
    state.metrics.request(label, response.status().as_u16());
    response
}

/// Whether `given` is `key`, in time that depends on neither's content (only on the lengths), so
/// that response times do not reveal how much of a guess was right.
fn key_matches(given: &[u8], key: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(given.ct_eq(key))
}

/// Unknown paths get OpenAI's error body too, not an empty 404.
async fn unknown_path(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no such endpoint: {}", uri.path()),
    )
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} does not accept {method}", uri.path()),
    )
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "headway",
        }],
    }))
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than the server's limit (--max-body-bytes)".to_string()
        } else {
            rejection.body_text()
        };
        ApiError {
            status,
            message,
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    })
}

/// A request body's endpoint-specific fields and its validated generation settings.
fn parse_request<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<(T, Settings), ApiError> {
    let body = parse_body(&body_bytes(body)?)?;
    let request = fields(&body)?;
    let settings = fields::<GenerationFields>(&body)?.validate(state.max_context)?;
    Ok((request, settings))
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (request, settings) = parse_request::<ChatRequest>(&state, body)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let messages = request
        .messages
        .iter()
        .map(|m| Ok(Message::new(&m.role, &m.text()?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let template = state.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "this model has no chat template: use /v1/completions",
        )
    })?;
    let prompt = template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let prompt_ids = tokenize(&state, &prompt, false)?;
    generate(state, prompt_ids, settings, Kind::Chat).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (request, settings) = parse_request::<CompletionRequest>(&state, body)?;
    let prompt_ids = tokenize(&state, request.prompt.text()?, true)?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    generate(state, prompt_ids, settings, Kind::Completion).await
}

fn tokenize(state: &AppState, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    state.tokenizer.encode(text, special).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            e.to_string(),
        )
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// Queues the job and answers with the whole completion or a stream of chunks.
async fn generate(
    state: Arc<AppState>,
    prompt_ids: Vec<u32>,
    settings: Settings,
    kind: Kind,
) -> Result<Response, ApiError> {
    let room = state.max_context.saturating_sub(prompt_ids.len());
    if room == 0 || settings.max_tokens.is_some_and(|m| m > room) {
        let mut error = ApiError::invalid(
            "messages",
            format!(
                "the prompt has {} tokens and {} more were asked for, but the context is {} tokens",
                prompt_ids.len(),
                settings.max_tokens.unwrap_or(0),
                state.max_context
            ),
        );
        error.code = Some("context_length_exceeded");
        return Err(error);
    }
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        max_tokens: settings
            .max_tokens
            .unwrap_or(state.default_max_tokens)
            .min(room),
        prompt_ids,
        sampling: settings.sampling,
        stop: settings.stop.clone(),
        events,
        arrived: Instant::now(),
    };
    match submit(&state.queue, job, &state.metrics) {
        Ok(()) => {}
        Err(Refused::Full) => {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_exceeded",
                format!(
                    "the server is busy: {} requests are already waiting; retry later",
                    state.metrics.queue_depth()
                ),
            ))
        }
        Err(Refused::Closed) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
            ))
        }
    }
    let id = format!(
        "{}-{:x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        rand::random::<u64>()
    );
    let reply = Reply {
        id,
        created: unix_time(),
        model: state.model_name.clone(),
        method: state.method.clone(),
        kind,
    };
    if settings.stream {
        Ok(reply
            .stream(receiver, settings.include_usage)
            .into_response())
    } else {
        reply.collect(receiver).await
    }
}

/// The fixed fields of one request's response.
struct Reply {
    id: String,
    created: u64,
    model: String,
    method: String,
    kind: Kind,
}

impl Reply {
    fn usage(&self, f: &Finished) -> (Usage, Speculative) {
        (
            Usage {
                prompt_tokens: f.prompt_tokens,
                completion_tokens: f.completion_tokens,
                total_tokens: f.prompt_tokens + f.completion_tokens,
            },
            Speculative {
                method: self.method.clone(),
                target_forwards: f.target_forwards,
                accepted_tokens: f.accepted_tokens,
                tau: f.completion_tokens as f64 / f.target_forwards.max(1) as f64,
            },
        )
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// A choice carrying `text` (a message, a delta or completion text).
    fn choice(
        &self,
        text: Option<&str>,
        finish_reason: Option<&str>,
        chunk: bool,
    ) -> serde_json::Value {
        match (self.kind, chunk) {
            (Kind::Chat, false) => serde_json::json!({
                "index": 0,
                "message": {"role": "assistant", "content": text.unwrap_or("")},
                "finish_reason": finish_reason,
            }),
            (Kind::Chat, true) => serde_json::json!({
                "index": 0,
                "delta": text.map_or(serde_json::json!({}), |t| serde_json::json!({"content": t})),
                "finish_reason": finish_reason,
            }),
            (Kind::Completion, _) => serde_json::json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        }
    }

    fn body(&self, choice: serde_json::Value, chunk: bool) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    async fn collect(self, mut receiver: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
        let mut text = String::new();
        while let Some(event) = receiver.recv().await {
            match event {
                Event::Text(piece) => text.push_str(&piece),
                Event::Failed(error) => return Err(error),
                Event::Done(finished) => {
                    let mut body = self.body(
                        self.choice(Some(&text), Some(finished.finish_reason), false),
                        false,
                    );
                    let (usage, speculative) = self.usage(&finished);
                    body["usage"] = serde_json::json!(usage);
                    body["speculative"] = serde_json::json!(speculative);
                    return Ok(Json(body).into_response());
                }
            }
        }
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the engine stopped before finishing",
        ))
    }

    fn stream(
        self,
        receiver: UnboundedReceiver<Event>,
        include_usage: bool,
    ) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
        let first = (self.kind == Kind::Chat).then(|| {
            let mut choice = self.choice(None, None, true);
            choice["delta"] = serde_json::json!({"role": "assistant", "content": ""});
            self.body(choice, true)
        });
        let reply = Arc::new(self);
        let events = UnboundedReceiverStream::new(receiver).map(move |event| {
            let reply = &reply;
            let body = match event {
                Event::Text(piece) => reply.body(reply.choice(Some(&piece), None, true), true),
                Event::Done(finished) => {
                    let mut body =
                        reply.body(reply.choice(None, Some(finished.finish_reason), true), true);
                    let (usage, speculative) = reply.usage(&finished);
                    if include_usage {
                        body["usage"] = serde_json::json!(usage);
                    }
                    body["speculative"] = serde_json::json!(speculative);
                    body
                }
                Event::Failed(error) => error.body(),
            };
            SseEvent::default().data(body.to_string())
        });
        let stream = tokio_stream::iter(first.map(|b| SseEvent::default().data(b.to_string())))
            .chain(events)
            .chain(tokio_stream::once(SseEvent::default().data("[DONE]")))
            .map(Ok);
        Sse::new(stream)
    }
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
