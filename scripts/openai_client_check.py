"""Talk to a running `headway-serve http` with the official `openai` client: chat and completion,
streamed and not. Exits non-zero on any mismatch. Run by serve/tests/http.rs.

Usage: python scripts/openai_client_check.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]
"""

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)

    models = client.models.list()
    model = models.data[0].id
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length"), reply
    assert reply.usage.completion_tokens >= 1, reply.usage

    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, (streamed, text)

    completion = client.completions.create(
        model=model, prompt="one two three", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text is not None, completion
    parts = client.completions.create(
        model=model, prompt="one two three", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == completion.choices[0].text

    try:
        client.chat.completions.create(model=model, messages=messages, temperature=-1)
    except openai.BadRequestError as error:
        assert "temperature" in str(error), error
    else:
        raise AssertionError("temperature -1 was accepted")
    print(f"openai {openai.__version__}: chat, streaming chat, completions and errors ok")


if __name__ == "__main__":
    main()
