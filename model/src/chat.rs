//! HF chat templates (`tokenizer_config.json` → `chat_template`) rendered with minijinja, set up
//! the way transformers sets up Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, Python string methods), so the same conversation yields the same text.

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{ModelError, Result};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special-token strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja source, kept so outputs made with the template can record which one it was.
    source: String,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat";

/// `chat_template` may be one string or a list of named templates (the "default" one is used).
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token is either its text or an `AddedToken` object with a `content` field.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenField {
    fn text(self) -> String {
        match self {
            Self::Text(t) | Self::Added { content: t } => t,
        }
    }
}

#[derive(Deserialize)]
struct TokenizerConfig {
    chat_template: Option<TemplateField>,
    bos_token: Option<TokenField>,
    eos_token: Option<TokenField>,
}

fn read_tokenizer_config(path: &Path) -> Result<TokenizerConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

impl ChatTemplate {
    /// The template of the HF model directory `dir`: `chat_template.jinja` (newer transformers
    /// save it there) or else `chat_template` in `tokenizer_config.json`; special-token strings
    /// always come from `tokenizer_config.json`. `Ok(None)` when there is no template.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        if !config_path.exists() {
            return Ok(None);
        }
        let mut config = read_tokenizer_config(&config_path)?;
        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.exists() {
            let text =
                std::fs::read_to_string(&jinja_path).map_err(|e| ModelError::io(&jinja_path, e))?;
            config.chat_template = Some(TemplateField::One(text));
        }
        Self::from_config(config, &config_path)
    }

    /// The template in the text of a `tokenizer_config.json` (`origin` labels errors: a GGUF
    /// file builds this text from its metadata); `Ok(None)` when it has none.
    pub fn from_tokenizer_config_text(text: &str, origin: &Path) -> Result<Option<Self>> {
        let config = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: origin.to_path_buf(),
            source,
        })?;
        Self::from_config(config, origin)
    }

    /// Reads the template from a `tokenizer_config.json`; `Ok(None)` when it has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        Self::from_config(read_tokenizer_config(path)?, path)
    }

    fn from_config(config: TokenizerConfig, path: &Path) -> Result<Option<Self>> {
        let template = match config.chat_template {
            None => return Ok(None),
            Some(TemplateField::One(t)) => t,
            Some(TemplateField::Named(list)) => {
                match list.into_iter().find(|t| t.name == "default") {
                    Some(t) => t.template,
                    None => {
                        return Err(ModelError::Template(format!(
                        "{}: chat_template lists named templates but none is called \"default\"",
                        path.display()
                    )))
                    }
                }
            }
        };
        let bos = config.bos_token.map(TokenField::text).unwrap_or_default();
        let eos = config.eos_token.map(TokenField::text).unwrap_or_default();
        // A template that does not compile is a fault of this file: say which.
        Self::new(template, bos, eos)
            .map_err(|e| match e {
                ModelError::Template(message) => {
                    ModelError::Template(format!("{}: {message}", path.display()))
                }
                other => other,
            })
            .map(Some)
    }

    /// Compiles `template`.
    pub fn new(template: String, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, template.clone())
            .map_err(|e| ModelError::Template(format!("cannot compile: {e:#}")))?;
        Ok(Self {
            env,
            source: template,
            bos_token,
            eos_token,
        })
    }

    /// What decides the rendering: the Jinja source and the BOS / EOS strings it is given.
    pub fn identity(&self) -> String {
        format!("{}\0{}\0{}", self.source, self.bos_token, self.eos_token)
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ModelError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => Value::from(Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| ModelError::Template(format!("cannot render: {e:#}")))
    }
}
