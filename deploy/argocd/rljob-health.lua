-- Argo CD health check for rljob.io/RLJob (resource.customizations.health.rljob.io_RLJob).
-- Healthy: Running, Succeeded. Progressing: Pending, Restarting, no status yet, or a spec change
-- the operator has not observed yet. Degraded: Degraded, Failed (with the operator's message).
-- Suspended: Suspended. A finished job (Succeeded, Failed) keeps its health even after a spec edit
-- the operator will not act on.
local hs = {}
local status = obj.status
local generation = obj.metadata ~= nil and obj.metadata.generation or nil

local function phase_message(st, phase)
  if st.message ~= nil and st.message ~= "" then
    return st.message
  end
  if st.conditions ~= nil then
    for _, condition in ipairs(st.conditions) do
      if condition.type == phase and condition.message ~= nil and condition.message ~= "" then
        return condition.message
      end
    end
  end
  return "RLJob is " .. phase
end

if status == nil or status.phase == nil or status.phase == "" then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile the RLJob"
  return hs
end

local phase = status.phase
local final = phase == "Succeeded" or phase == "Failed"
if not final and generation ~= nil
    and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. string.format("%d", generation)
  return hs
end

local health = {
  Running = "Healthy",
  Succeeded = "Healthy",
  Pending = "Progressing",
  Restarting = "Progressing",
  Degraded = "Degraded",
  Failed = "Degraded",
  Suspended = "Suspended",
}
hs.status = health[phase] or "Unknown"
hs.message = phase_message(status, phase)
return hs
