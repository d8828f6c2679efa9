"""JSON schemas the structured-output tests generate against (notebook 05b): nested objects, arrays with bounds, enums,
`anyOf`, patterns, required and optional fields, numbers with ranges. Each can be finished within a few hundred tokens
(arrays have `maxItems`, strings that a random model writes have `maxLength`, a pattern or an enum)."""

NAME = {"type": "string", "maxLength": 24}
SHORT = {"type": "string", "maxLength": 8}
AGE = {"type": "integer", "minimum": 0, "maximum": 130}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}
COLOUR = {"enum": ["red", "green", "blue"]}
FLAG = {"type": "boolean"}
CODE = {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}
EMAIL = {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def obj(required: dict, optional: dict | None = None) -> dict:
    "An object schema with these required and optional properties."
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required)}


def array(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS = [
    obj({"name": NAME, "age": AGE}),
    obj({"name": NAME}, {"age": AGE}),
    obj({"ok": FLAG}),
    obj({"colour": COLOUR}),
    obj({"code": CODE}),
    obj({"email": EMAIL}),
    obj({"date": DATE}),
    obj({"score": SCORE}),
    obj({"count": {"type": "integer"}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    obj({"tags": array(SHORT, 1, 3)}),
    obj({"colours": array(COLOUR, 0, 4)}),
    obj({"scores": array(SCORE, 1, 2)}),
    obj({"matrix": array(array({"type": "integer", "minimum": 0, "maximum": 9}, 1, 2), 1, 2)}),
    obj({"person": obj({"name": NAME, "age": AGE})}),
    obj({"person": obj({"name": NAME}, {"email": EMAIL})}),
    obj({"a": obj({"b": obj({"c": FLAG})})}),
    obj({"owner": obj({"first": SHORT, "last": SHORT}), "pets": array(obj({"kind": {"enum": ["cat", "dog"]}}), 0, 2)}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}}),
    obj({"value": {"anyOf": [SHORT, {"type": "boolean"}]}}),
    obj({"id": {"anyOf": [CODE, {"type": "integer", "minimum": 1, "maximum": 999}]}}),
    obj({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9, "maximum": 9},
         "y": {"type": "integer", "minimum": -9, "maximum": 9}}),
    obj({"status": {"enum": ["open", "closed", "pending"]}, "priority": {"enum": [1, 2, 3]}}),
    obj({"yes": {"enum": [True, False, None]}}),
    obj({"name": NAME, "colour": COLOUR, "ok": FLAG}),
    obj({"name": NAME, "age": AGE}, {"email": EMAIL, "tags": array(SHORT, 0, 2)}),
    obj({}, {"name": NAME, "age": AGE}),
    obj({"title": {"type": "string", "minLength": 1, "maxLength": 30}}),
    obj({"letter": {"type": "string", "pattern": "^[a-z]$"}}),
    obj({"word": {"type": "string", "pattern": "^[A-Za-z]{2,10}$"}}),
    obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}}),
    obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$", "maxLength": 11}}),
    obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}),
    obj({"level": {"type": "integer", "minimum": 1, "maximum": 5}, "note": SHORT}),
    obj({"point": array({"type": "number", "minimum": -1, "maximum": 1}, 2, 2)}),
    obj({"rows": array(obj({"k": SHORT, "v": AGE}), 1, 3)}),
    obj({"ids": array({"type": "integer", "minimum": 0, "maximum": 1000}, 1, 4)}),
    obj({"flags": array(FLAG, 1, 3)}),
    obj({"meta": obj({}, {"created": DATE, "by": NAME})}),
    obj({"event": obj({"date": DATE, "where": SHORT}), "guests": array(NAME, 0, 2)}),
    obj({"choice": {"oneOf": [{"const": "left"}, {"const": "right"}]}}),
    obj({"shape": {"anyOf": [obj({"r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                             obj({"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "h": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    obj({"answer": {"type": ["string", "null"], "maxLength": 12}}),
    obj({"n": {"type": "integer", "minimum": 100, "maximum": 200}}),
    obj({"neg": {"type": "integer", "minimum": -100, "maximum": -1}}),
    obj({"currency": {"enum": ["EUR", "USD", "GBP"]}, "amount": {"type": "number", "minimum": 0, "maximum": 1000}}),
    obj({"user": obj({"id": AGE, "roles": array({"enum": ["admin", "user"]}, 1, 2)})}),
    obj({"lines": array({"type": "string", "maxLength": 16}, 1, 2)}),
    obj({"grid": array(array(FLAG, 2, 2), 2, 2)}),
    obj({"name": NAME, "address": obj({"street": NAME, "city": SHORT}, {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    array(obj({"n": AGE}), 1, 3),
    array(COLOUR, 1, 2),
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "integer", "minimum": 0, "maximum": 10},
    {"type": "boolean"},
]
