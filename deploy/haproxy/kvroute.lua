-- kvroute.lua: HAProxy (2.6+, Lua 5.3) asks kvroute where an OpenAI request should go.
--
-- haproxy.cfg runs the action `lua.kvroute_route <backend> <kvroute address>` on
-- POST /v1/completions and /v1/chat/completions, with `option http-buffer-request` so
-- that the body is there. The action sends kvroute's POST /v1/route the prompt it finds
-- (token ids when the body has them, else the text or the chat messages and their
-- template fields; `model` and `cache_salt` as given), through the address of haproxy.cfg's
-- `listen kvroute_api` section, whose timeouts are the deadline and which never
-- retries. When kvroute names an instance that is a server of <backend>, the action sets
--
--   txn.kvroute_server    the server's name (haproxy.cfg: use-server)
--   txn.kvroute_rank      kvroute's dp_rank (haproxy.cfg: X-data-parallel-rank)
--   txn.kvroute_instance  kvroute's instance id (haproxy.cfg: a response header)
--
-- and otherwise txn.kvroute_fallback, the reason the request is load balanced as usual:
-- routing only ever changes how much of a prompt is served from cache, never whether
-- the request is served. The question is never a probe: the request goes where the
-- answer says, so kvroute's placement guess for it is right.
--
-- The body is read, never parsed into tables: the values kvroute needs are found as spans
-- of the client's own bytes and passed on as they are.

local MAX_DEPTH = 64     -- deeper JSON is not routed (it is forwarded all the same)
local ASK_TIMEOUT_MS = 10000  -- a safety net only: the kvroute_api section answers sooner

-- JSON scanning. Each function takes the text and the index of a value's first byte and
-- returns the index just past that value, or nil when the text is not JSON there.

local function skip_ws(s, i)
    return s:find("[^ \t\r\n]", i)
end

local function scan_string(s, i)
    local j = i + 1
    while true do
        local k = s:find("[\"\\\0-\31]", j)
        if not k then
            return nil
        end
        local b = s:byte(k)
        if b == 34 then                       -- the closing quote
            return k + 1
        elseif b ~= 92 then                   -- a raw control character
            return nil
        end
        local e = s:byte(k + 1)
        if e == 117 then                      -- \uXXXX
            if not s:find("^%x%x%x%x", k + 2) then
                return nil
            end
            j = k + 6
        elseif e and ("\"\\/bfnrt"):find(string.char(e), 1, true) then
            j = k + 2
        else
            return nil
        end
    end
end

local scan_value

local function scan_container(s, i, depth)
    if depth >= MAX_DEPTH then
        return nil
    end
    local object = s:byte(i) == 123
    local close = object and 125 or 93
    i = skip_ws(s, i + 1)
    if not i then
        return nil
    end
    if s:byte(i) == close then
        return i + 1
    end
    while true do
        if object then
            if s:byte(i) ~= 34 then
                return nil
            end
            i = scan_string(s, i)
            i = i and skip_ws(s, i)
            if not i or s:byte(i) ~= 58 then  -- ':'
                return nil
            end
            i = skip_ws(s, i + 1)
            if not i then
                return nil
            end
        end
        i = scan_value(s, i, depth + 1)
        i = i and skip_ws(s, i)
        if not i then
            return nil
        end
        local b = s:byte(i)
        if b == close then
            return i + 1
        elseif b ~= 44 then                   -- ','
            return nil
        end
        i = skip_ws(s, i + 1)
        if not i then
            return nil
        end
    end
end

scan_value = function(s, i, depth)
    local b = s:byte(i)
    if b == 34 then
        return scan_string(s, i)
    elseif b == 123 or b == 91 then
        return scan_container(s, i, depth)
    end
    for _, word in ipairs({"true", "false", "null"}) do
        if s:sub(i, i + #word - 1) == word then
            return i + #word
        end
    end
    local _, stop = s:find("^-?%d+", i)
    if not stop then
        return nil
    end
    local _, fraction = s:find("^%.%d+", stop + 1)
    stop = fraction or stop
    local _, exponent = s:find("^[eE][-+]?%d+", stop + 1)
    return (exponent or stop) + 1
end

-- The members of the JSON object that is the whole text: raw key -> {first, last} byte
-- of the value (the last of duplicate keys wins, as in Python's json); nil if the text
-- is not one JSON object.
local function members(s)
    local i = skip_ws(s, 1)
    if not i or s:byte(i) ~= 123 then
        return nil
    end
    local out = {}
    i = skip_ws(s, i + 1)
    if not i then
        return nil
    end
    if s:byte(i) == 125 then
        return (not skip_ws(s, i + 1)) and out or nil
    end
    while true do
        if s:byte(i) ~= 34 then
            return nil
        end
        local after_key = scan_string(s, i)
        if not after_key then
            return nil
        end
        local key = s:sub(i + 1, after_key - 2)
        i = skip_ws(s, after_key)
        if not i or s:byte(i) ~= 58 then
            return nil
        end
        local first = skip_ws(s, i + 1)
        local stop = first and scan_value(s, first, 1)
        if not stop then
            return nil
        end
        out[key] = {first, stop - 1}
        i = skip_ws(s, stop)
        if not i then
            return nil
        end
        local b = s:byte(i)
        if b == 125 then
            return (not skip_ws(s, i + 1)) and out or nil
        elseif b ~= 44 then
            return nil
        end
        i = skip_ws(s, i + 1)
        if not i then
            return nil
        end
    end
end

local function is_empty_array(s, first)
    return s:byte(first) == 91 and s:byte(skip_ws(s, first + 1) or 0) == 93
end

local CHAT_TEMPLATE_FIELDS = {"tools", "chat_template_kwargs", "add_generation_prompt",
                              "continue_final_message", "add_special_tokens", "chat_template"}

-- kvroute's question (a JSON text) for an OpenAI request body, or nil and the reason
-- there is none. Mirrors kvroute's own proxy: a batch is routed by its first prompt.
local function question(path, body)
    local m = members(body)
    if not m then
        return nil, "the body is not a JSON object"
    end
    local parts = {}
    -- A tenant's salt too: vLLM caches its blocks apart, and kvroute matches them only with it.
    for _, key in ipairs({"model", "cache_salt"}) do
        local span = m[key]
        if span then
            local raw = body:sub(span[1], span[2])
            if raw:byte(1) == 34 then
                parts[#parts + 1] = "\"" .. key .. "\":" .. raw
            elseif raw ~= "null" then
                return nil, key .. " is not a string"
            end
        end
    end
    if path == "/v1/chat/completions" then
        local span = m.messages
        if not span or body:byte(span[1]) ~= 91 or is_empty_array(body, span[1]) then
            return nil, "no messages"
        end
        parts[#parts + 1] = "\"messages\":" .. body:sub(span[1], span[2])
        -- The chat template renders these too: without them kvroute tokenizes another prompt.
        for _, key in ipairs(CHAT_TEMPLATE_FIELDS) do
            local field = m[key]
            if field then
                parts[#parts + 1] = "\"" .. key .. "\":" .. body:sub(field[1], field[2])
            end
        end
    else
        local span = m.prompt
        if not span then
            return nil, "no prompt"
        end
        local first, last = span[1], span[2]
        if body:byte(first) == 91 then
            local inner = skip_ws(body, first + 1)
            local b = body:byte(inner)
            if b == 34 or b == 91 then        -- a batch of prompts: its first one
                first, last = inner, scan_value(body, inner, 1) - 1
            end
        end
        local b = body:byte(first)
        if b == 34 then
            parts[#parts + 1] = "\"prompt\":" .. body:sub(first, last)
        elseif b == 91 and not is_empty_array(body, first) then
            parts[#parts + 1] = "\"token_ids\":" .. body:sub(first, last)
        else
            return nil, "no prompt"
        end
    end
    return "{" .. table.concat(parts, ",") .. "}"
end

-- A JSON string value without escapes, or nil.
local function plain_string(s, span)
    if not span or s:byte(span[1]) ~= 34 then
        return nil
    end
    local text = s:sub(span[1] + 1, span[2] - 1)
    if text:find("[\\%c]") then
        return nil
    end
    return text
end

-- "host:port" of an instance URL (an origin), the port spelled out; nil if it is not one.
local function authority(url)
    local scheme, host, port = url:match("^(https?)://(%[[%x:.]+%]):?(%d*)$")
    if not scheme then
        scheme, host, port = url:match("^(https?)://([%w.%-]+):?(%d*)$")
    end
    if not scheme then
        return nil
    end
    if port == "" then
        port = scheme == "https" and "443" or "80"
    end
    return host:gsub("^%[(.*)%]$", "%1") .. ":" .. port
end

-- The server of `backend` that the answer names: the one at the URL's address, else the
-- one named like kvroute's instance id.
local function server_of(backend, url, instance)
    local proxy = core.backends[backend]
    if not proxy then
        return nil
    end
    local wanted = authority(url)
    local by_name = nil
    for name, server in pairs(proxy.servers) do
        local addr = server:get_addr():gsub("^%[(.*)%]", "%1")
        if wanted and addr == wanted then
            return name
        end
        if name == instance then
            by_name = name
        end
    end
    return by_name
end

-- {server =, rank =, instance =} for the server kvroute chose; or nil and the reason.
local function ask(backend, api, q)
    local ok, reply = pcall(function()
        local client = core.httpclient()
        return client:post{
            url = "http://kvroute/v1/route", dst = api, body = q, timeout = ASK_TIMEOUT_MS,
            headers = {["content-type"] = {"application/json"}},
        }
    end)
    if not ok or type(reply) ~= "table" then
        return nil, "kvroute: " .. tostring(reply)
    end
    local status = tonumber(reply.status) or 0
    if status ~= 200 then
        -- 503/504 from the kvroute_api section: kvroute is down or past the deadline;
        -- 4xx: kvroute cannot route this request (the instance will say what it thinks).
        local level = status >= 500 and core.warning or core.info
        core.log(level, "kvroute.lua: kvroute answered HTTP " .. status
                 .. "; the request is load balanced as usual")
        return nil, "kvroute HTTP " .. status
    end
    local body = reply.body or ""
    local m = members(body)
    local url = m and plain_string(body, m.url)
    local instance = m and plain_string(body, m.instance)
    local rank = m and m.dp_rank and body:sub(m.dp_rank[1], m.dp_rank[2])
    if not (url and authority(url) and instance and instance:find("^[\33-\126]+$")
            and #instance <= 200 and rank and rank:find("^%d+$")) then
        core.Warning("kvroute.lua: kvroute's answer has no usable url, dp_rank and instance")
        return nil, "kvroute: an unusable answer"
    end
    local server = server_of(backend, url, instance)
    if not server then
        core.Warning("kvroute.lua: kvroute chose " .. url .. ", which is not a server of "
                     .. backend .. "; the request is load balanced as usual")
        return nil, "kvroute chose an instance outside the backend"
    end
    return {server = server, rank = rank, instance = instance}
end

core.register_action("kvroute_route", {"http-req"}, function(txn, backend, api)
    local body = txn.sf:req_body() or ""
    local q, why
    if (tonumber(txn.sf:req_body_size()) or 0) > #body then
        why = "the body is larger than the buffer"  -- tune.bufsize holds part of it only
    else
        q, why = question(txn.sf:path(), body)
    end
    local choice
    if q then
        choice, why = ask(backend, api, q)
    end
    if not choice then
        txn:set_var("txn.kvroute_fallback", why)
        return
    end
    txn:set_var("txn.kvroute_server", choice.server)
    txn:set_var("txn.kvroute_rank", choice.rank)
    txn:set_var("txn.kvroute_instance", choice.instance)
end, 2)
