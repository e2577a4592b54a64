from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Counters(_message.Message):
    __slots__ = ("scored", "unparsed", "admitted", "first_measure_wrong")
    SCORED_FIELD_NUMBER: _ClassVar[int]
    UNPARSED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_MEASURE_WRONG_FIELD_NUMBER: _ClassVar[int]
    scored: int
    unparsed: int
    admitted: int
    first_measure_wrong: int
    def __init__(self, scored: _Optional[int] = ..., unparsed: _Optional[int] = ..., admitted: _Optional[int] = ..., first_measure_wrong: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("task", "pool_size", "pool_source", "voices", "style", "checker", "counters", "heldout_pool_size", "openings_histogram", "version", "replica", "details_json")
    class OpeningsHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    VOICES_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPENINGS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    task: str
    pool_size: int
    pool_source: str
    voices: int
    style: str
    checker: str
    counters: Counters
    heldout_pool_size: int
    openings_histogram: _containers.ScalarMap[int, int]
    version: str
    replica: str
    details_json: str
    def __init__(self, task: _Optional[str] = ..., pool_size: _Optional[int] = ..., pool_source: _Optional[str] = ..., voices: _Optional[int] = ..., style: _Optional[str] = ..., checker: _Optional[str] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., heldout_pool_size: _Optional[int] = ..., openings_histogram: _Optional[_Mapping[int, int]] = ..., version: _Optional[str] = ..., replica: _Optional[str] = ..., details_json: _Optional[str] = ...) -> None: ...

class CasesRequest(_message.Message):
    __slots__ = ("limit", "split")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    split: str
    def __init__(self, limit: _Optional[int] = ..., split: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chord(_message.Message):
    __slots__ = ("measure", "chord_symbol")
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    CHORD_SYMBOL_FIELD_NUMBER: _ClassVar[int]
    measure: float
    chord_symbol: str
    def __init__(self, measure: _Optional[float] = ..., chord_symbol: _Optional[str] = ...) -> None: ...

class Progression(_message.Message):
    __slots__ = ("key", "chords")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHORDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    chords: _containers.RepeatedCompositeFieldContainer[Chord]
    def __init__(self, key: _Optional[str] = ..., chords: _Optional[_Iterable[_Union[Chord, _Mapping]]] = ...) -> None: ...

class Case(_message.Message):
    __slots__ = ("id", "split", "task", "voices", "style", "chords", "messages", "openings", "prefixes", "progression", "details_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    VOICES_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    CHORDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPENINGS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PROGRESSION_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    split: str
    task: str
    voices: int
    style: str
    chords: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    openings: _containers.RepeatedScalarFieldContainer[str]
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    progression: Progression
    details_json: str
    def __init__(self, id: _Optional[str] = ..., split: _Optional[str] = ..., task: _Optional[str] = ..., voices: _Optional[int] = ..., style: _Optional[str] = ..., chords: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., openings: _Optional[_Iterable[str]] = ..., prefixes: _Optional[_Iterable[str]] = ..., progression: _Optional[_Union[Progression, _Mapping]] = ..., details_json: _Optional[str] = ...) -> None: ...

class CasesReply(_message.Message):
    __slots__ = ("cases", "pool_size")
    CASES_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZE_FIELD_NUMBER: _ClassVar[int]
    cases: _containers.RepeatedCompositeFieldContainer[Case]
    pool_size: int
    def __init__(self, cases: _Optional[_Iterable[_Union[Case, _Mapping]]] = ..., pool_size: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("case_id", "completion")
    CASE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    case_id: str
    completion: str
    def __init__(self, case_id: _Optional[str] = ..., completion: _Optional[str] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("case_id", "reward", "format_ok", "admitted", "verdict", "failing_rules", "sounding_frames", "expected_frames", "status", "test_metric", "details_json", "opening", "first_measure_ok")
    CASE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FORMAT_OK_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    FAILING_RULES_FIELD_NUMBER: _ClassVar[int]
    SOUNDING_FRAMES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEST_METRIC_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    OPENING_FIELD_NUMBER: _ClassVar[int]
    FIRST_MEASURE_OK_FIELD_NUMBER: _ClassVar[int]
    case_id: str
    reward: float
    format_ok: bool
    admitted: bool
    verdict: str
    failing_rules: _containers.RepeatedScalarFieldContainer[str]
    sounding_frames: int
    expected_frames: int
    status: str
    test_metric: float
    details_json: str
    opening: str
    first_measure_ok: bool
    def __init__(self, case_id: _Optional[str] = ..., reward: _Optional[float] = ..., format_ok: bool = ..., admitted: bool = ..., verdict: _Optional[str] = ..., failing_rules: _Optional[_Iterable[str]] = ..., sounding_frames: _Optional[int] = ..., expected_frames: _Optional[int] = ..., status: _Optional[str] = ..., test_metric: _Optional[float] = ..., details_json: _Optional[str] = ..., opening: _Optional[str] = ..., first_measure_ok: bool = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[ScoreReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[ScoreReply, _Mapping]]] = ...) -> None: ...
