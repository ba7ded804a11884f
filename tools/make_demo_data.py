"""Generate the demo's synthetic multi-turn chat data: ilab_nb/assets/demo_chat/{train,eval}.jsonl, and the
preference pairs and plain-text documents built from the same atlas:
ilab_nb/assets/demo_chat/{pref_train,pref_eval,text_train,text_eval}.jsonl.

    python tools/make_demo_data.py            # writes ilab_nb/assets/demo_chat/
    python tools/make_demo_data.py --out DIR  # writes DIR/train.jsonl and DIR/eval.jsonl

The task is an invented atlas: 24 invented countries, each with a capital, a currency and a national
animal (72 facts). Every user turn asks one fact, in one of several phrasings, sometimes after some
small talk, sometimes as a follow-up ("And its currency?") that names no country, so the answer depends
on an earlier turn. Every assistant turn is the bare answer (one word), so an answer can be checked by
exact match.

"Held-out" means: no evaluation conversation appears in the training file (checked below). Every fact
and every phrasing in the evaluation file also occurs in training; what is new is the combination,
order, small talk and system message around them. The demo therefore measures whether the model
learned the facts and the question forms, not knowledge of unseen facts.

The preference pairs (for DPO) are conversations of the same kind cut after a user question: the prompt is the
conversation up to it (TRL's "prompt" as messages), "chosen" the right answer, "rejected" the same attribute of
another country (a wrong fact of the right type). Held-out pairs never repeat a training pair's prompt.

The documents (for continued pretraining on plain text) are short encyclopedia-like paragraphs about one to three
countries, in several sentence forms; held-out documents are new combinations of the same facts and forms.

Standalone (standard library only) and deterministic: a fixed seed for `random.Random`, so re-running
it writes byte-identical files.
"""
import argparse, json, random
from pathlib import Path

SEED = 20240611
N_TRAIN, N_EVAL = 2400, 200
N_PREF_TRAIN, N_PREF_EVAL = 800, 100
PREF_SEED = SEED + 1              # its own generator: the chat files stay as they were
N_TEXT_TRAIN, N_TEXT_EVAL = 400, 40
TEXT_SEED = SEED + 2
SENTENCES = {
    'capital': ['The capital of {c} is {v}.', '{v} is the capital city of {c}.', 'Its government sits in {v}.'],
    'currency': ['People in {c} pay with the {v}.', 'The currency of {c} is called {v}.', 'Prices there are given in {v}.'],
    'animal': ['The national animal of {c} is the {v}.', '{c} chose the {v} as its national animal.',
               'The {v} appears on its flag.'],
}
OPENINGS = ['{c} is a small country.', '{c} lies far from the sea.', 'Few travellers know {c}.', '{c} is a quiet place.']
N_COUNTRIES = 24

SYLLABLES = ['ka', 'lo', 'mi', 'ra', 'to', 'ven', 'dor', 'sel', 'qua', 'bri', 'nu', 'zan', 'pel', 'vor',
             'thi', 'gal', 'mer', 'osk', 'lun', 'fen', 'tar', 'iri', 'bel', 'cru']
COUNTRY_ENDINGS = ['ia', 'land', 'mora', 'stan', 'ovia', 'heim']
ANIMALS = ['otter', 'heron', 'lynx', 'badger', 'falcon', 'tortoise', 'gecko', 'walrus', 'bison', 'marten',
           'ibis', 'puffin', 'jackal', 'mantis', 'salamander', 'osprey', 'tapir', 'ferret', 'moose',
           'pelican', 'lemur', 'beetle', 'raven', 'seal']
ATTRIBUTES = ['capital', 'currency', 'animal']

QUESTIONS = {
    'capital': ['What is the capital of {c}?', 'Which city is the capital of {c}?', 'Name the capital of {c}.',
                "What's the capital city of {c}?", 'Tell me the capital of {c}.', '{c} has which capital?'],
    'currency': ['What is the currency of {c}?', 'Which currency is used in {c}?', 'Name the currency of {c}.',
                 'What money do people use in {c}?', 'Tell me the currency of {c}.', '{c} pays with which currency?'],
    'animal': ['What is the national animal of {c}?', 'Which animal is the symbol of {c}?',
               'Name the national animal of {c}.', "What's {c}'s national animal?",
               'Tell me the national animal of {c}.', '{c} chose which national animal?'],
}
FOLLOW_UPS = {
    'capital': ['And its capital?', 'What about its capital city?', 'And the capital there?'],
    'currency': ['And its currency?', 'What about the money there?', 'And which currency does it use?'],
    'animal': ['And its national animal?', 'What about its national animal?', 'And the animal on its flag?'],
}
SMALL_TALK = [
    "I'm planning a trip next summer.", 'My cousin keeps asking me about geography.', 'Quick question.',
    "I've been reading an old atlas this week.", 'This is for a quiz night with friends.',
    'Sorry if this is obvious.', 'I always forget this one.', 'Help me settle a bet.',
    'We were arguing about it at dinner yesterday and nobody could remember the answer.',
    'My teacher mentioned it in class, but I did not write it down.',
    'I found a postcard in a drawer and it made me curious.',
    'I am writing a short story set in a faraway place and want the details right.',
    "Thanks for the last answer, that was useful.", 'One more thing.',
]
SYSTEMS = [
    'You are a helpful atlas. Answer with one word.',
    'Reply with the answer only.',
    'You are a terse geography assistant.',
    'You are an assistant for a travel agency that specializes in small and little-known countries. '
    'Customers ask short factual questions about capitals, currencies and national animals. '
    'Always answer with the single word that answers the question, with no explanation and no punctuation.',
]


def invent_world(rng):
    """Invented countries with a capital, a currency and a national animal each (all names distinct)."""
    used = set()
    def word(n_syll, ending=''):
        while True:
            w = (''.join(rng.choice(SYLLABLES) for _ in range(n_syll)) + ending).capitalize()
            if w not in used: used.add(w); return w
    animals = ANIMALS[:]; rng.shuffle(animals)
    return [dict(country=word(2, rng.choice(COUNTRY_ENDINGS)), capital=word(rng.choice([2, 3])),
                 currency=word(2).lower(), animal=animals[i]) for i in range(N_COUNTRIES)]


def user_turn(rng, question):
    """The question, after 0-3 sentences of small talk (most turns have none: a long tail of lengths)."""
    k = rng.choices([0, 1, 2, 3], weights=[55, 25, 12, 8])[0]
    return ' '.join(rng.sample(SMALL_TALK, k) + [question])


def conversation(rng, world):
    """2-3 user/assistant exchanges; a follow-up turn reuses the previous turn's country."""
    messages = []
    if rng.random() < 0.35: messages.append({'role': 'system', 'content': rng.choice(SYSTEMS)})
    entry, asked = None, set()
    for turn in range(rng.choice([2, 2, 3])):
        follow = entry is not None and rng.random() < 0.3
        if not follow: entry = rng.choice(world)
        attr = rng.choice([a for a in ATTRIBUTES if (entry['country'], a) not in asked] or ATTRIBUTES)
        asked.add((entry['country'], attr))
        q = rng.choice(FOLLOW_UPS[attr]) if follow else rng.choice(QUESTIONS[attr]).format(c=entry['country'])
        messages += [{'role': 'user', 'content': user_turn(rng, q)}, {'role': 'assistant', 'content': entry[attr]}]
    return {'messages': messages}


def make(seed=SEED):
    """The train and eval conversation lists; eval conversations never occur in train."""
    rng = random.Random(seed)
    world = invent_world(rng)
    train = [conversation(rng, world) for _ in range(N_TRAIN)]
    seen = {json.dumps(c, sort_keys=True) for c in train}
    evals = []
    while len(evals) < N_EVAL:
        c = conversation(rng, world)
        key = json.dumps(c, sort_keys=True)
        if key not in seen: seen.add(key); evals.append(c)
    return train, evals


def preference_pair(rng, world):
    """A conversation cut after its last question: {prompt, chosen, rejected}, the rejected answer another country's."""
    c = conversation(rng, world)["messages"]
    prompt, right = c[:-1], c[-1]["content"]
    attr = next(a for a in ATTRIBUTES for e in world if e[a] == right)
    wrong = rng.choice([e[attr] for e in world if e[attr] != right])
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": right}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def make_preferences(seed=PREF_SEED):
    """Train and eval preference pairs of the demo's atlas; no eval prompt occurs in train."""
    rng = random.Random(seed)
    world = invent_world(random.Random(SEED))        # the same atlas as the chat data
    train = [preference_pair(rng, world) for _ in range(N_PREF_TRAIN)]
    seen = {json.dumps(p["prompt"], sort_keys=True) for p in train}
    evals = []
    while len(evals) < N_PREF_EVAL:
        p = preference_pair(rng, world)
        key = json.dumps(p["prompt"], sort_keys=True)
        if key not in seen: seen.add(key); evals.append(p)
    return train, evals


def document(rng, world):
    """A paragraph about one to three countries: an opening sentence each, then its facts in random forms and order."""
    parts = []
    for e in rng.sample(world, rng.choice([1, 1, 2, 3])):
        parts.append(rng.choice(OPENINGS).format(c=e['country']))
        for a in rng.sample(ATTRIBUTES, rng.choice([2, 3])):
            parts.append(rng.choice(SENTENCES[a]).format(c=e['country'], v=e[a]))
    return {'text': ' '.join(parts)}


def make_documents(seed=TEXT_SEED):
    """Train and eval documents of the demo's atlas; no eval document occurs in train."""
    rng = random.Random(seed)
    world = invent_world(random.Random(SEED))
    train = [document(rng, world) for _ in range(N_TEXT_TRAIN)]
    seen = {d['text'] for d in train}
    evals = []
    while len(evals) < N_TEXT_EVAL:
        d = document(rng, world)
        if d['text'] not in seen: seen.add(d['text']); evals.append(d)
    return train, evals


def write_jsonl(path, rows):
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        for r in rows: f.write(json.dumps(r, ensure_ascii=False) + '\n')


def main(argv=None):
    default = Path(__file__).resolve().parent.parent / 'ilab_nb' / 'assets' / 'demo_chat'
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--out', type=Path, default=default, help=f'output folder (default: {default})')
    out = p.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    train, evals = make()
    write_jsonl(out / 'train.jsonl', train)
    write_jsonl(out / 'eval.jsonl', evals)
    ptrain, peval = make_preferences()
    write_jsonl(out / 'pref_train.jsonl', ptrain)
    write_jsonl(out / 'pref_eval.jsonl', peval)
    dtrain, deval = make_documents()
    write_jsonl(out / 'text_train.jsonl', dtrain)
    write_jsonl(out / 'text_eval.jsonl', deval)
    print(f'wrote {len(train)} train and {len(evals)} eval conversations, {len(ptrain)} train and {len(peval)} eval '
          f'preference pairs, {len(dtrain)} train and {len(deval)} eval documents to {out}')


if __name__ == '__main__':
    main()
