//! `headway-serve`'s front ends to the speculative engine ([`headway_engine`]): the command line
//! ([`generate`], the drafting [`options`] every front end shares), the Spec-Bench benchmark
//! ([`bench`], with its SVG chart and `compare`) and the OpenAI-compatible HTTP server and its
//! load test ([`http`]).

pub mod bench;
pub mod generate;
pub mod http;
pub mod options;
