/*
 * kvroute.js: nginx (njs 0.7+) asks kvroute where an OpenAI request should go.
 *
 * nginx.conf calls route() as the content handler of /v1/completions and
 * /v1/chat/completions, once nginx has read the request body. route() sends kvroute's
 * POST /v1/route the prompt it finds (token ids when the body has them, else the text or
 * the chat messages and their template fields; `model` and `cache_salt` as given) and
 * then hands the request to one of two named locations, unchanged:
 *
 *   @kvroute   kvroute answered: proxy_pass to $kvroute_target (the instance's URL) with
 *              X-data-parallel-rank: $kvroute_rank;
 *   @fallback  anything else (kvroute slow, down, answering an error or something odd, a
 *              body that is not a routable OpenAI request): the regular upstream group.
 *
 * Routing only ever changes how much of a prompt is served from cache, never whether the
 * request is served. The question is never a probe: the request goes where the answer
 * says, so kvroute's placement guess for it is right.
 *
 * Settings, all in nginx.conf: $kvroute_url (kvroute's base URL), js_fetch_timeout (the
 * deadline for kvroute's whole answer), and the environment variable KVROUTE_API_TOKEN
 * (kvroute's api_token, sent as a bearer token on the /v1/route call only; nginx passes
 * it to this script only when nginx.conf names it with `env`).
 */

// The answer's url must be an origin: proxy_pass keeps the client's path only then.
const ORIGIN = /^https?:\/\/[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^https?:\/\/\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$/;
const INSTANCE_ID = /^[\x21-\x7e]{1,200}$/;

// kvroute's question for an OpenAI request body, or a string saying why there is none.
const CHAT_TEMPLATE_FIELDS = ['tools', 'chat_template_kwargs', 'add_generation_prompt',
                              'continue_final_message', 'add_special_tokens', 'chat_template'];

// Mirrors kvroute's own proxy: a batch of prompts is routed by its first prompt.
function question(uri, text) {
    let body;
    try {
        body = JSON.parse(text);
    } catch (e) {
        return 'the body is not JSON';
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
        return 'the body is not a JSON object';
    }
    const ask = {};
    // A tenant's salt too: vLLM caches its blocks apart, and kvroute matches them only with it.
    const named = ['model', 'cache_salt'];
    for (let i = 0; i < named.length; i++) {  // (this njs has no for...of)
        const key = named[i];
        if (body[key] !== undefined && body[key] !== null) {
            if (typeof body[key] !== 'string') {
                return key + ' is not a string';
            }
            ask[key] = body[key];
        }
    }
    if (uri === '/v1/chat/completions') {
        if (!Array.isArray(body.messages) || body.messages.length === 0) {
            return 'no messages';
        }
        ask.messages = body.messages;
        // The chat template renders these too: without them kvroute tokenizes another prompt.
        CHAT_TEMPLATE_FIELDS.forEach(function (key) {  // (this njs has no for...of)
            if (body[key] !== undefined) {
                ask[key] = body[key];
            }
        });
        return ask;
    }
    let prompt = body.prompt;
    if (Array.isArray(prompt) && prompt.length > 0
        && (typeof prompt[0] === 'string' || Array.isArray(prompt[0]))) {
        prompt = prompt[0];
    }
    if (typeof prompt === 'string') {
        ask.prompt = prompt;
    } else if (Array.isArray(prompt) && prompt.length > 0) {
        ask.token_ids = prompt;
    } else {
        return 'no prompt';
    }
    return ask;
}

// The instance kvroute chose, or a string saying why its answer is not used.
async function ask(r, q) {
    const headers = {'Content-Type': 'application/json'};
    const token = process.env.KVROUTE_API_TOKEN;
    if (token) {
        headers.Authorization = 'Bearer ' + token;
    }
    const base = r.variables.kvroute_url;
    let reply;
    try {
        reply = await ngx.fetch(base + '/v1/route',
                                {method: 'POST', headers: headers, body: JSON.stringify(q)});
    } catch (e) {
        return 'kvroute: ' + e.message;  // refused, unreachable, or past js_fetch_timeout
    }
    // njs 0.7 mishandles `await` inside an expression: each await is a statement of its own.
    let text;
    try {
        text = await reply.text();
    } catch (e) {
        return 'kvroute: ' + e.message;
    }
    let answer;
    try {
        answer = JSON.parse(text);
    } catch (e) {
        return 'kvroute: HTTP ' + reply.status + ', not JSON';
    }
    if (reply.status !== 200) {
        // 4xx: kvroute cannot route this request (an unknown model, a prompt it refuses);
        // the instance will say what it thinks of it. 5xx: kvroute is in trouble.
        const why = answer && answer.error !== undefined ? JSON.stringify(answer.error) : '';
        const message = 'kvroute.js: kvroute answered HTTP ' + reply.status + ' '
                        + why.slice(0, 300) + '; the request goes to the upstream group';
        if (reply.status >= 500) {
            r.warn(message);
        } else {
            r.log(message);
        }
        return 'kvroute HTTP ' + reply.status;
    }
    if (answer === null || typeof answer !== 'object'
        || typeof answer.url !== 'string' || !ORIGIN.test(answer.url)
        || !Number.isInteger(answer.dp_rank) || answer.dp_rank < 0
        || typeof answer.instance !== 'string' || !INSTANCE_ID.test(answer.instance)) {
        return 'kvroute: an answer without a usable url, dp_rank and instance';
    }
    return answer;
}

async function route(r) {
    let choice = 'not a POST';
    if (r.method === 'POST') {
        let text;
        try {
            text = r.requestText;  // throws when nginx kept the body in a file
        } catch (e) {
            text = undefined;
        }
        if (typeof text !== 'string' || text.length === 0) {
            choice = 'no body in memory';
        } else {
            choice = question(r.uri, text);
            if (typeof choice !== 'string') {
                choice = await ask(r, choice);
            }
            if (typeof choice === 'string' && choice.startsWith('kvroute: ')) {
                r.warn('kvroute.js: ' + choice + '; the request goes to the upstream group');
            }
        }
    }
    if (typeof choice === 'string') {
        r.variables.kvroute_fallback = choice;
        r.internalRedirect('@fallback');
        return;
    }
    r.variables.kvroute_target = choice.url;
    r.variables.kvroute_rank = String(choice.dp_rank);
    r.variables.kvroute_instance = choice.instance;
    r.internalRedirect('@kvroute');
}

export default {route, question};
