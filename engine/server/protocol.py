"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names, defaults and ranges follow the OpenAI API reference; vLLM's sampling
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``), ``cache_salt`` and ``kv_transfer_params`` (disaggregated
prefill and decode, as vLLM's router sends it) are accepted as extra body fields
(``extra_body=`` in the openai SDK). Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Torch's generator seeds are 64-bit; the engine derives child seeds as seed + i.
MAX_SEED = 2**63 - 1 - 1024
MAX_N = 128

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="send a last chunk with token usage")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", description="a name for the schema")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="accepted; answers always follow the schema")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = None
    choice: list[str] | None = Field(None, description="the answer is one of these strings")
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's GBNF dialect)")


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="a served model name; omitted = the default model")
    n: int = Field(1, ge=1, le=MAX_N, description="completions to generate for each prompt")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="makes sampling reproducible for the same request")
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(
        None, description="strings that end generation (not included in the text)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id -> value in [-100, 100] added to its logit before sampling")
    user: str | None = Field(None, description="end-user id (accepted, not used)")
    priority: int = Field(0, description="vLLM extension: with --scheduling-policy priority, "
                                         "lower values are served first")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (JSON following "
                          "json_schema.schema)")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM extension: constrain the answer to a JSON schema, a regex, a "
                          "choice of strings or a grammar")
    # vLLM's older names of structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: NonEmptyStr | None = Field(
        None, description="kvpilot/vLLM extension: requests share prefix-cache blocks only "
                          "when their cache_salt is equal (tenant isolation)")
    prefix_cache_details: bool = Field(
        False, description="kvpilot extension: usage.prompt_tokens_details gets "
                           "prefix_cache_misses, one entry per prompt saying why its uncached "
                           "tokens missed the prefix cache (null: none did)")
    # vLLM sampling extensions
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extension (disaggregated prefill and decode, what vLLM's router sends): "
                          "do_remote_decode asks a prefill engine to hold the prompt's KV and return where it "
                          "lies; do_remote_prefill with the remote_* fields it returned makes a decode engine "
                          "read it")


class CompletionRequest(SamplingRequest):
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(16, ge=1, description="None = up to the context length")
    logprobs: int | None = Field(None, ge=0,
                                 description="log-probabilities of the sampled and this many top "
                                             "tokens (at most --max-logprobs)")
    echo: bool = Field(False, description="not supported; must be false")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only equal to n is supported")
    suffix: str | None = Field(None, description="not supported; must be null")


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageFunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of the conversation sent back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this result answers")
    reasoning_content: str | None = Field(None, description="assistant: its reasoning")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="None = up to the context length")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="at most --max-logprobs")
    tools: list[ChatCompletionTool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools; needs --enable-auto-tool-choice), "
                          "required, or a named function")
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (tool_choice required)")
    add_generation_prompt: bool = Field(True, description="vLLM extension")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra variables for the chat template")


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    # extra fields (``prefix_cache_misses``) appear only when a request asks for them, so
    # an OpenAI client sees exactly OpenAI's shape otherwise
    model_config = ConfigDict(extra="allow")

    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="the stop token id or string that fired")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extension: where a prefill engine holds the prompt's KV (with "
                          "do_remote_decode), for the decode engine")


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="with --reasoning-parser")
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extension: where a prefill engine holds the prompt's KV (with "
                          "do_remote_decode), for the decode engine")


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvpilot"
    root: str | None = None
    parent: str | None = None      # a LoRA adapter's base model (as vLLM lists adapters)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizePromptRequest(BaseModel):
    """Tokenize plain text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add BOS etc. as the model does")


class TokenizeChatRequest(BaseModel):
    """Tokenize a conversation rendered with the chat template."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True


TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class RenderedPrompt(BaseModel):
    """One prompt as the engine would run it (``/v1/completions/render``,
    ``/v1/chat/completions/render``): what vLLM's router reads to route on cached blocks."""

    token_ids: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
